#!/usr/bin/env python3
"""Benchmark ``moe-offload replay``: accesses per second of the whole command on one core.

    python scripts/bench_replay.py [--layers 48 --experts 128 --top-k 8 --tokens 2000
                                    --prompt 256 --capacity 20% --policy lru --repeats 3]

Writes a synthetic trace (binary and CSV) to a temp dir, runs the replay command as a child
process pinned to one CPU (``taskset -c 0`` where available), and prints, for each input
format: the command, best wall seconds, CPU seconds, and trace accesses per second (the trace's
rows / wall time; the Belady ceiling the command also computes is part of that time) and per
CPU second (the same figure on an idle core; on a shared machine the wall figure also counts
time other processes held the core). Then an
in-process breakdown of where the time goes (read, prepare, the policy's manager run, the
Belady ceiling, the report; and the manager's own belady run for comparison).
"""
from __future__ import annotations

import argparse
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from runtime.traces.files import write_trace  # noqa: E402
from runtime.traces.synthetic import SynthTraceSpec, synthesize  # noqa: E402

TARGET = 1_500_000  # accesses/s, whole command, one core


def _child_cpu() -> float:
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


def time_command(cmd: list[str], repeats: int) -> tuple[float, float]:
    """Best wall seconds and the CPU seconds of that run."""
    best = (float("inf"), 0.0)
    for _ in range(repeats):
        cpu0, t0 = _child_cpu(), time.perf_counter()
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                       cwd=ROOT)
        wall, cpu = time.perf_counter() - t0, _child_cpu() - cpu0
        best = min(best, (wall, cpu))
    return best


def breakdown(path: Path, capacity: str, policy: str) -> list[tuple[str, float]]:
    from runtime.commands.replay import parse_capacity
    from dataclasses import replace

    from runtime.replay.harness import _run, prepare
    from runtime.replay.report import matrix_markdown
    from runtime.residency.config import preset_config
    from runtime.traces.files import read_trace

    out = []
    t = time.process_time()
    trace = read_trace(path)
    out.append(("read trace", time.process_time() - t))
    t = time.process_time()
    prep = prepare(trace, name=str(path))
    out.append(("prepare (batches, cold misses)", time.process_time() - t))
    cap = parse_capacity(capacity).resolve(trace.header.total_expert_bytes)
    t = time.process_time()
    cell = _run(prep, cap, preset_config(policy), policy, capacity)
    out.append((f"manager run: {policy}", time.process_time() - t))
    t = time.process_time()
    prep.next_use()
    out.append(("next_use (offline)", time.process_time() - t))
    t = time.process_time()
    ceiling = prep.ceiling(cap)
    out.append(("belady ceiling (the core, belady preset)", time.process_time() - t))
    from runtime.replay.belady import belady_ceiling
    t = time.process_time()
    belady_ceiling(prep.trace, cap, prep.next_use())
    out.append(("belady.py's loop (the tests' reference)", time.process_time() - t))
    t = time.process_time()
    matrix_markdown([replace(cell, belady_prefill_demand_miss_bytes=ceiling.demand_miss_bytes[0],
                             belady_decode_demand_miss_bytes=ceiling.demand_miss_bytes[1])])
    out.append(("report", time.process_time() - t))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=2000, help="prompt + decode tokens")
    ap.add_argument("--prompt", type=int, default=256, help="prompt tokens (rest: decode)")
    ap.add_argument("--capacity", default="20%")
    ap.add_argument("--policy", default="lru")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()

    spec = SynthTraceSpec(n_layer=args.layers, n_expert=args.experts, top_k=args.top_k,
                          prompt_tokens=args.prompt, decode_tokens=args.tokens - args.prompt)
    trace = synthesize(spec)
    n = len(trace)
    tmp = Path(tempfile.mkdtemp(prefix="bench-replay-"))
    try:
        pin = ["taskset", "-c", "0"] if shutil.which("taskset") else []
        exe = shutil.which("moe-offload")
        base = [exe] if exe else [sys.executable, "-m", "runtime.cli"]
        print(f"trace: {args.layers} layers x {args.experts} experts, top-{args.top_k}, "
              f"{args.prompt} prompt + {args.tokens - args.prompt} decode tokens = {n:,} "
              f"accesses; one core{' (taskset -c 0)' if pin else ' (taskset missing)'}; "
              f"best of {args.repeats}; load average {os.getloadavg()[0]:.1f}")
        for suffix in (".rtb", ".csv"):
            path = tmp / f"bench{suffix}"
            write_trace(trace, path)
            cmd = pin + base + ["replay", str(path), "--capacity", args.capacity,
                                "--policy", args.policy, "--json"]
            wall, cpu = time_command(cmd, args.repeats)
            print(f"  {suffix[1:]:>3}: {wall:5.2f} s wall -> {n / wall:9,.0f} accesses/s "
                  f"({n / wall / TARGET:.2f}x the {TARGET:,}/s target); {cpu:5.2f} s CPU -> "
                  f"{n / cpu:9,.0f} accesses per CPU second ({n / cpu / TARGET:.2f}x)")
            print(f"       $ {' '.join(cmd)}")
        print("in-process breakdown (CPU seconds, .rtb input):")
        for what, sec in breakdown(tmp / "bench.rtb", args.capacity, args.policy):
            print(f"  {what:<46} {sec:6.3f} s  ({n / max(sec, 1e-9):11,.0f} accesses/s)")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
