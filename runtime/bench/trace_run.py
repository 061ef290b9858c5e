"""One row of the real-scale benchmark, measured in this process: load a model, then play a
routing trace (``--route-trace``: the trace's prompt, then every decode row) from a cold page
cache, and report what a user waits for.

``python -m runtime.bench.trace_run`` reads a JSON job on stdin (model, trace, row, threads) and
writes one JSON object on stdout: load seconds, time to first token, decode t/s over the
trace's decode tokens, bytes read from storage during the decode, and, for managed rows, the
manager's decode counters (hits, accesses, demand-miss bytes, prefetches). The parent
(scripts/bench_realscale.py) runs each row in a fresh process, under a memory limit where
asked, and watches its memory from outside (runtime/bench/memwatch.py).
"""
from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import asdict, dataclass, field


@dataclass(frozen=True)
class TraceRow:
    """One row of the table: how the model is loaded and run."""

    name: str                       # the table's "row" cell
    kind: str                       # "llama.cpp" (residency off) | "managed"
    repack: bool | None = None      # llama.cpp's CPU weight repacking (None: its default)
    config: dict | None = None      # residency TOML as a dict (managed)
    config_path: str | None = None  # or a file (managed); its [devices] replaced by budget
    budget_bytes: int | None = None  # the cpu budget of a managed row
    cost: dict | None = None        # a [cost] table replacing the config's (this machine's)
    note: str = ""
    env: dict = field(default_factory=dict)

    def to_json(self) -> dict:
        return asdict(self)


def _residency_config(row: TraceRow):
    import dataclasses  # noqa: PLC0415

    from runtime.residency.config import load_config, parse_config  # noqa: PLC0415

    if row.kind != "managed":
        return None
    mine = parse_config({"devices": {"cpu": int(row.budget_bytes)},
                         **({"cost": row.cost} if row.cost else {})}, source=row.name)
    base = load_config(row.config_path) if row.config_path else \
        parse_config(row.config or {}, source=row.name)
    return dataclasses.replace(base, devices=mine.devices,
                               **({"cost": mine.cost} if row.cost else {}))


def progress(**fields) -> None:
    """One ``@@ {json}`` line on stderr: the parent reads how far a row got (a row it stops at
    its time limit still reports its load, first token and decode rate so far)."""
    sys.stderr.write("@@ " + json.dumps(fields) + "\n")
    sys.stderr.flush()


def run_row(model: str, trace: str, row: TraceRow, *, threads: int | None, n_ctx: int = 512,
            report=progress) -> dict:
    """Load, play the trace once, and measure (see the module docstring)."""
    from runtime.bench.memwatch import process_read_bytes  # noqa: PLC0415
    from runtime.engine.hook.imposed_routing import imposed_request  # noqa: PLC0415
    from runtime.engine.engine import Engine, EngineSettings  # noqa: PLC0415
    from runtime.engine.sampling import SamplingParams  # noqa: PLC0415
    from runtime.residency.types import Phase  # noqa: PLC0415

    settings = EngineSettings(model_path=model, n_ctx=n_ctx, n_threads=threads,
                              n_threads_batch=threads, manage_residency=row.kind == "managed",
                              config=_residency_config(row), repack=row.repack,
                              route_trace=trace)
    pid = os.getpid()
    t0 = time.perf_counter()
    engine = Engine(settings, progress=False)
    load_s = time.perf_counter() - t0
    report(load_s=load_s)
    try:
        prompt, params = imposed_request(engine, None, SamplingParams(temperature=0.0),
                                         _NoArgs())
        before = _decode_counters(engine, Phase.DECODE)
        tier = next((t for t in engine.tiers if type(t).__name__ == "RamTier"), None)
        io_start = tier.io.counters() if tier is not None else None
        io_decode = None
        t1 = time.perf_counter()
        first_at, io_first, last = None, 0, None
        n = 0
        for chunk in engine.generate(prompt, params):
            if chunk.token is not None:
                now = time.perf_counter()
                if first_at is None:
                    first_at = now
                    io_first = process_read_bytes(pid)
                    io_decode = tier.io.counters() if tier is not None else None
                    report(load_s=load_s, ttft_s=first_at - t1, read=io_first)
                else:
                    n += 1
                    report(load_s=load_s, ttft_s=first_at - t1, decoded=n,
                           decode_s=now - first_at, read=process_read_bytes(pid) - io_first)
            last = chunk
        t2 = time.perf_counter()
        io_end = process_read_bytes(pid)
        after = _decode_counters(engine, Phase.DECODE)
        timings = last.timings
        decode_tokens = max(timings.completion_tokens - 1, 0)   # tokens that were decoded
        decode_s = t2 - first_at if first_at is not None else 0.0
        out = {
            "load_s": load_s,
            "ttft_s": (first_at - t1) if first_at is not None else None,
            "prompt_tokens": timings.prompt_tokens,
            "decode_tokens": decode_tokens,
            "decode_tps": decode_tokens / decode_s if decode_s > 0 else 0.0,
            "read_bytes_per_decode_token": (io_end - io_first) / decode_tokens
            if decode_tokens else None,
            "lazy_experts": bool(getattr(engine, "lazy_experts", False)),
            "threads": list(engine.threads.current()),   # (decode, prompt) as run
            "threads_note": engine.threads.describe(),
            "imposed": engine.imposed.note() if engine.imposed is not None else None,
        }
        if before is not None:
            out["decode"] = {k: after[k] - before[k] for k in after}
        if tier is not None:
            out["tier_notices"] = list(tier.notices)
            io_end = tier.io.counters()
            out["reads"] = {"prompt": _read_counters(io_start, io_decode),
                            "decode": _read_counters(io_decode or io_end, io_end)}
        return out
    finally:
        engine.close()


def _read_counters(a, b) -> dict:
    """The tier's reads between two ``StepCounters``: bytes read, the share of them already
    in when first needed (the overlap), and the seconds a thread waited for reads."""
    read = b.read_bytes - a.read_bytes
    ready, late = b.ready_bytes - a.ready_bytes, b.late_bytes - a.late_bytes
    return {"read_bytes": read, "ready_bytes": ready, "late_bytes": late,
            "overlap": ready / (ready + late) if ready + late else None,
            "wait_s": b.wait_s - a.wait_s, "step_s": b.step_s - a.step_s}


class _NoArgs:
    """No -p and no -n: the trace's own prompt and every decode row."""

    predict_given = False


def _decode_counters(engine, phase) -> dict | None:
    manager, devices = engine.manager, engine.residency_devices
    if manager is None or not devices:
        return None
    c = manager.snapshot().device(devices[0]).phase(phase)
    return {name: int(getattr(c, name)) for name in (
        "accesses", "hits", "demand_miss_bytes", "prefetch_issued_bytes",
        "prefetch_used_bytes", "prefetch_wasted_bytes")}


def main() -> int:
    from runtime.bench.worker import serve_job  # noqa: PLC0415

    return serve_job(lambda job: run_row(job["model"], job["trace"], TraceRow(**job["row"]),
                                         threads=job["threads"]),
                     lambda job: job["row"].get("env"))


if __name__ == "__main__":
    sys.exit(main())
