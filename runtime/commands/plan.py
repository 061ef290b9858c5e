"""``moe-offload plan``: a ready residency TOML for a model on this machine.

    moe-offload plan -m MODEL [-c N] [-o FILE] [--free DEVICE=SIZE ...] [--rpc HOST:PORT ...]

Reads the free memory of every device (GPUs through ggml's device API, RAM through psutil),
subtracts what the dense weights and the KV cache need, and prints a residency config with a
budget per device and the policies, each number explained in a comment
(runtime/planner.py). ``--free`` states a device's free memory instead of
measuring it (planning for another machine). ``--rpc`` adds remote devices (moe-offload
rpc-server) that answer a short probe. The TOML passes ``config check`` and runs with
``--config``.
"""
from __future__ import annotations

import argparse
import sys

from runtime.atomic_write import write_text
from runtime.errors import UserError
from runtime.units import parse_size


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "plan", help="print a residency config (budgets per device, policies) for a model "
                     "on this machine",
        description="Plan expert placement for a model from the free memory of this "
                    "machine's devices: dense weights and KV cache first, then expert "
                    "budgets per device, fastest first. Prints a residency TOML.")
    p.add_argument("-m", "--model", required=True, metavar="FILE", help="GGUF model file")
    p.add_argument("-c", "--ctx-size", type=int, default=4096, metavar="N",
                   help="context size in tokens the KV cache must hold")
    p.add_argument("-o", "--output", metavar="FILE", help="write the TOML here (default: "
                                                          "stdout)")
    p.add_argument("--free", action="append", default=[], metavar="DEVICE=SIZE",
                   help="assume DEVICE (cpu, cuda:N, vulkan:N) has SIZE free instead of "
                        "measuring it; repeatable")
    p.add_argument("--rpc", action="append", default=[], metavar="HOST:PORT[/N]",
                   help="a remote device (moe-offload rpc-server) to include when it answers a "
                        "3 s probe: 80%% of the free memory it reports; repeatable")
    p.set_defaults(func=run)


def _stated(values: list[str]) -> dict[str, int]:
    out = {}
    for text in values:
        device, sep, size = text.partition("=")
        if not sep or not device:
            raise UserError(f"--free: expected DEVICE=SIZE, got {text!r}")
        try:
            out[device.strip()] = parse_size(size.strip())
        except ValueError as err:
            raise UserError(f"--free {device}: {err}") from None
    return out


def run(args: argparse.Namespace) -> int:
    from runtime.planner import plan_model  # noqa: PLC0415

    result = plan_model(args.model, args.ctx_size, _stated(args.free), args.rpc,
                        warn=lambda line: print(line, file=sys.stderr))
    text = result.to_toml()
    if args.output:
        write_text(args.output, text)
        sys.stderr.write(f"moe-offload: wrote {args.output} (run with -ngl {result.gpu_layers} "
                         f"--config {args.output})\n")
    else:
        sys.stdout.write(text)
    return 0
