"""``moe-offload native build|status``: the patched llama.cpp with the device cache."""
from __future__ import annotations

import argparse
import json
import sys

from runtime.errors import UserError


def register(subparsers) -> None:
    parser = subparsers.add_parser("native", help="build / inspect the patched llama.cpp "
                                   "every command runs on")
    sub = parser.add_subparsers(dest="native_command", metavar="ACTION")
    b = sub.add_parser("build", help="apply llamacpp/patches and build the libraries (cached); "
                       "the build becomes the one every command loads")
    b.add_argument("--backend", default=None,
                   help="cpu | cuda | vulkan (default: what CMAKE_ARGS names, as at install: "
                        "-DGGML_CUDA=on cuda, -DGGML_VULKAN=on vulkan, else cpu)")
    b.add_argument("--source", default=None, metavar="PATH",
                   help="llama-cpp-python 0.3.36 sdist (.tar.gz), its unpacked tree, a llama.cpp "
                        "tree or a pruned archive; default: the repository's "
                        "offline/ archive")
    b.add_argument("--cuda-arch", default=None, metavar="ARCH",
                   help="CMAKE_CUDA_ARCHITECTURES for --backend cuda (default: native)")
    b.add_argument("--no-cuda-fa", action="store_true",
                   help="skip the FlashAttention CUDA kernels (about half the compile time; "
                        "attention then runs without flash attention)")
    b.add_argument("--generic-cpu", action="store_true",
                   help="no -march=native (a build to copy to other machines)")
    b.add_argument("--no-rpc", action="store_true",
                   help="leave out ggml's RPC backend (GGML_RPC; built by default: "
                        "`moe-offload rpc-server` and rpc:HOST:PORT devices need it)")
    b.add_argument("-j", "--jobs", type=int, default=None, help="parallel compile jobs")
    b.add_argument("--json", action="store_true", help="print the build record as JSON")
    b.set_defaults(func=_build)
    s = sub.add_parser("status", help="what is built, where, for which backends")
    s.add_argument("--json", action="store_true", help="machine-readable output")
    s.set_defaults(func=_status)
    parser.set_defaults(func=lambda args: (parser.print_help(sys.stderr), 2)[1])


def _build(args: argparse.Namespace) -> int:
    import dataclasses  # noqa: PLC0415

    from runtime.native.build import build  # noqa: PLC0415
    from runtime.native.install import record_install, request_from_cmake_args  # noqa: PLC0415

    if args.jobs is not None and args.jobs < 1:
        raise UserError(f"--jobs {args.jobs}: must be at least 1")
    req = request_from_cmake_args()
    req = dataclasses.replace(req, backend=args.backend or req.backend, source=args.source,
                              cuda_arch=args.cuda_arch, cuda_fa=not args.no_cuda_fa,
                              native_cpu=not args.generic_cpu, jobs=args.jobs,
                              rpc=not args.no_rpc)
    info = build(req)
    record_install(info)
    if args.json:
        print(json.dumps(info.to_dict(), indent=2))
    else:
        print(f"built {info.backend}{' + rpc' if info.rpc else ''}: {info.lib_dir}")
        print("every moe-offload command loads it from now on (LLAMA_CPP_LIB_PATH=DIR "
              "overrides)")
    return 0


def _status(args: argparse.Namespace) -> int:
    from runtime.native.status import format_status, native_status  # noqa: PLC0415

    status = native_status()
    print(json.dumps(status, indent=2) if args.json else format_status(status))
    return 0
