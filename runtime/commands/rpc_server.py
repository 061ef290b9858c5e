"""``moe-offload rpc-server``: offer this machine's memory and compute to a remote llama.cpp
(ggml-rpc). Unauthenticated: loopback by default."""
from __future__ import annotations

import argparse

from runtime.rpc.server import NO_AUTH_WARNING


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "rpc-server", help="serve a local device over llama.cpp's RPC backend (no "
                           "authentication: loopback by default)",
        description="Start llama.cpp's RPC server (ggml-rpc, from `moe-offload native build "
                    "--rpc`) offering one local device. Another machine then names it in its "
                    "residency config as [devices] \"rpc:HOST:PORT\" = \"12GiB\". "
                    f"SECURITY: {NO_AUTH_WARNING}; it binds 127.0.0.1 unless --host says "
                    "otherwise, and warns when it does. Ctrl-C stops it (exit 130).")
    p.add_argument("--host", default="127.0.0.1",
                   help="IPv4 address to listen on (default 127.0.0.1; 0.0.0.0 exposes it "
                        "to every network this machine is on, unauthenticated)")
    p.add_argument("--port", default="50052", help="TCP port (default 50052)")
    p.add_argument("-t", "--threads", type=int, default=None,
                   help="compute threads (default: all cores)")
    p.add_argument("--cache", default=None, metavar="DIR",
                   help="ggml-rpc's local tensor cache: large tensors the client sent once "
                        "are kept in DIR by hash and not sent again")
    p.add_argument("--device", default="cpu",
                   help="the local device to offer: cpu (default), cuda:N, vulkan:N")
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    from runtime.device_names import parse_port  # noqa: PLC0415
    from runtime.rpc.server import ServerSettings, run_server  # noqa: PLC0415

    return run_server(ServerSettings(host=args.host, port=parse_port(args.port, "--port"),
                                     threads=args.threads, cache_dir=args.cache,
                                     device=args.device))
