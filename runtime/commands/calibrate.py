"""``moe-offload calibrate``: measure this machine's copy and CPU expert-matmul rates.

    moe-offload calibrate [--size 256MiB] [--repeats 5] [--storage MODEL.gguf]

Prints host memcpy GB/s, the CPU's expert GEMV rate (weight bytes streamed per second: what
decode, one token per expert, is bound by) and GEMM rate (GFLOP/s: what a prefill chunk is
bound by), then a ``[cost]`` TOML snippet for ``moe-offload replay --cost`` or a residency config.
numpy's BLAS works on float32 weights while llama.cpp runs quantized kernels, so treat the
matmul figures as the machine's order of magnitude, not llama.cpp's exact speed.
"""
from __future__ import annotations

import argparse
import time

import numpy as np

from runtime.errors import UserError
from runtime.units import format_size, parse_size


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("calibrate", help="measure memcpy and CPU matmul rates for the "
                                                "replay cost model")
    p.add_argument("--size", default="256MiB",
                   help="bytes per memcpy / GEMV weight matrix (units allowed)")
    p.add_argument("--repeats", type=int, default=5, help="runs per measurement (best kept)")
    p.add_argument("--storage", metavar="FILE", default=None,
                   help="also measure cold reads from FILE's disk (a model file: its pages are "
                        "dropped from the page cache first), as the RAM tier reads experts: "
                        "random 3 MiB ranges, 8 in flight -> storage_gbps")
    p.set_defaults(func=run)


def _best_seconds(fn, repeats: int) -> float:
    fn()  # warm up: page faults, BLAS thread start
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return max(best, 1e-9)


def measure_memcpy_gbps(n_bytes: int, repeats: int) -> float:
    """Host RAM to RAM copy rate, GB/s (1e9 B/s)."""
    src = np.ones(n_bytes // 8, dtype=np.float64)
    dst = np.empty_like(src)
    return src.nbytes / _best_seconds(lambda: np.copyto(dst, src), repeats) / 1e9


def measure_gemv_gbps(n_bytes: int, repeats: int) -> float:
    """Weight bytes per second of a float32 matrix-vector product (decode-like), GB/s."""
    cols = 4096
    rows = max(1, n_bytes // (4 * cols))
    w = np.random.default_rng(0).standard_normal((rows, cols), dtype=np.float32)
    x = np.ones(cols, dtype=np.float32)
    return w.nbytes / _best_seconds(lambda: w @ x, repeats) / 1e9


def measure_gemm_gflops(repeats: int, n: int = 1024) -> float:
    """float32 matrix-matrix rate (prefill-like), GFLOP/s."""
    rng = np.random.default_rng(1)
    a = rng.standard_normal((n, n), dtype=np.float32)
    b = rng.standard_normal((n, n), dtype=np.float32)
    return 2.0 * n**3 / _best_seconds(lambda: a @ b, repeats) / 1e9


def measure_storage_gbps(path: str, *, span: int = 3 << 20, n_reads: int = 64,
                         in_flight: int = 8) -> float:
    """Cold read rate of ``path``'s disk, GB/s: ``n_reads`` random ``span``-byte ranges read
    with ``in_flight`` preads at a time after the file's pages were dropped from the page cache
    (the RAM tier's access pattern: one expert's bytes per read). The file is opened read-only
    and its pages are dropped again afterwards."""
    import os  # noqa: PLC0415
    from concurrent.futures import ThreadPoolExecutor  # noqa: PLC0415

    from runtime.ramtier.pager import drop_file_cache  # noqa: PLC0415

    size = os.path.getsize(path)
    if size < 2 * span:
        raise UserError(f"--storage: {path} is too small to measure ({format_size(size)}); "
                        f"give a model file of at least {format_size(64 * span)}")
    n_reads = min(n_reads, size // span)
    rng = np.random.default_rng(0)
    offsets = rng.choice(size // span, size=n_reads, replace=False) * span
    drop_file_cache(path)
    fd = os.open(path, os.O_RDONLY)
    try:
        def read(offset: int) -> int:
            return len(os.pread(fd, span, int(offset)))

        t0 = time.perf_counter()
        with ThreadPoolExecutor(in_flight) as pool:
            total = sum(pool.map(read, offsets))
        seconds = time.perf_counter() - t0
    finally:
        os.close(fd)
        drop_file_cache(path)
    return total / max(seconds, 1e-9) / 1e9


def run(args: argparse.Namespace) -> int:
    try:
        size = parse_size(args.size)
    except ValueError as err:
        raise UserError(f"--size: {err}") from None
    if size < (1 << 20) or size > (8 << 30):
        raise UserError(f"--size: {args.size} is outside 1MiB..8GiB")
    if not 1 <= args.repeats <= 100:
        raise UserError(f"--repeats: {args.repeats} is outside 1..100")
    storage = None
    if args.storage is not None:
        import os  # noqa: PLC0415

        if not os.path.isfile(args.storage):
            raise UserError(f"--storage: {args.storage}: no such file")
        storage = measure_storage_gbps(args.storage)
    memcpy = measure_memcpy_gbps(size, args.repeats)
    gemv = measure_gemv_gbps(size, args.repeats)
    gemm = measure_gemm_gflops(args.repeats)
    print(f"host memcpy ({format_size(size)}):      {memcpy:8.1f} GB/s")
    print(f"CPU expert GEMV (f32, weights):  {gemv:8.1f} GB/s")
    print(f"CPU expert GEMM (f32, 1024^3):   {gemm:8.1f} GFLOP/s")
    if storage is not None:
        print(f"storage cold reads (3 MiB x 8):  {storage:8.2f} GB/s")
    print()
    print("# measured by `moe-offload calibrate`; link and GPU rates are not measured here")
    print("[cost]")
    print(f"cpu_mem_gbps = {gemv:.1f}   # decode: expert weights streamed by the CPU")
    print(f"cpu_gflops = {gemm:.1f}    # prefill: CPU expert matmul")
    if storage is not None:
        print(f"storage_gbps = {storage:.2f}   # file -> RAM: the RAM tier's misses and prefetches")
    print(f"# host memcpy: {memcpy:.1f} GB/s (an upper bound for RAM-tier copies)")
    return 0
