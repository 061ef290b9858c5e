"""The real-scale benchmark's table (scripts/bench_realscale.py): one markdown row per run, the
ceiling's ratio beside each row at the same threads, and each managed row against llama.cpp
``--no-repack`` and ``lru`` at the same threads and read-ahead.

A run is the script's ``Run`` (``.row``: a TraceRow, ``.threads``, ``.ceiling``); a result is
the dict its child process reported (runtime/bench/trace_run.py) plus what the script measured
around it (peak RAM, the machine's load, the read-ahead, the share of the file cached).
"""
from __future__ import annotations

from typing import Any

GIB = 1 << 30
Run = Any       # scripts/bench_realscale.py's Run (a script: not importable from here)


def fmt(value, spec: str, none: str = "-") -> str:
    return none if value is None else format(value, spec)


def _threads(r: dict, run: Run) -> str:
    t = r.get("threads")
    if t:
        return f"{t[0]}/{t[1]}"
    return "default" if run.threads is None else str(run.threads)


def _reads(r: dict) -> tuple[str, str]:
    """(overlap %, wait ms per decode token) of the RAM tier's decode reads, or dashes."""
    reads = (r.get("reads") or {}).get("decode")
    n = r.get("decode_tokens") or 0
    if not reads or not n:
        return "-", "-"
    overlap = reads.get("overlap")
    return (fmt(overlap is not None and 100 * overlap, ".0f"),
            f"{1000 * reads['wait_s'] / n:.1f}")


def table(case: Case, results: list[tuple[Run, dict, int | None]]) -> list[str]:
    head = ("row", "threads", "read-ahead KiB", "budget", "load s", "TTFT s", "decode t/s",
            "ms/tok (x ceiling)", "disk MB/tok", "overlap %", "wait ms/tok", "peak RAM GiB",
            "hit %", "decode demand-miss MB (live)", "replay MB", "live/replay",
            "prefetch used / issued MB", "machine load")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    ceiling = {_threads(r, run): r["decode_tps"] for run, r, _ in results
               if run.ceiling and "died" not in r and r.get("decode_tps")}
    for run, r, predicted in results:
        row = run.row
        ra = "-" if run.ceiling else str(r.get("read_ahead_kb", "-"))
        load = r.get("load", "-")
        if "died" in r:
            p = r.get("partial") or {}
            cells = [row.name, _threads(r, run), ra, row.note, fmt(p.get("load_s"), ".1f"),
                     fmt(p.get("ttft_s"), ".2f"),
                     f"({p['decode_tps']:.3f})" if p.get("decoded") else "-", "-",
                     fmt(p.get("read_bytes_per_decode_token") and
                         p["read_bytes_per_decode_token"] / 1e6, ".1f"), "-", "-",
                     f"{r.get('peak_ram_bytes', 0) / GIB:.2f}", "-", "-", "-", "-",
                     r["died"], load]
            lines.append("| " + " | ".join(cells) + " |")
            continue
        d = r.get("decode")
        hit = 100 * d["hits"] / d["accesses"] if d and d["accesses"] else None
        live = d["demand_miss_bytes"] if d else None
        ratio = live / predicted if live is not None and predicted else None
        pf = (f"{d['prefetch_used_bytes'] / 1e6:.0f} / {d['prefetch_issued_bytes'] / 1e6:.0f}"
              if d and d["prefetch_issued_bytes"] else "-")
        tps = r["decode_tps"]
        base = ceiling.get(_threads(r, run))
        ms = f"{1000 / tps:.0f}" + (f" ({base / tps:.2f}x)" if base and not run.ceiling else "") \
            if tps else "-"
        overlap, wait = _reads(r)
        note = row.note
        if r.get("cached_at_start", 1.0) < 0.995:    # the ceiling row read part of its file
            note += f" ({100 * r['cached_at_start']:.1f}% of the file cached at its start)"
        cells = [row.name, _threads(r, run), ra, note, f"{r['load_s']:.1f}",
                 fmt(r.get("ttft_s"), ".2f"), f"{tps:.2f}", ms,
                 fmt(r.get("read_bytes_per_decode_token") is not None and
                     r["read_bytes_per_decode_token"] / 1e6, ".1f"), overlap, wait,
                 f"{r['peak_ram_bytes'] / GIB:.2f}", fmt(hit, ".1f"),
                 fmt(live and live / 1e6, ".0f"), fmt(predicted and predicted / 1e6, ".0f"),
                 fmt(ratio, ".3f"), pf, load]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", *summary(results)]
    return lines


def summary(results: list[tuple[Run, dict, int | None]]) -> list[str]:
    """Each managed row against llama.cpp --no-repack at the same threads and read-ahead
    (its rate so far when it was stopped), and against lru."""
    out = []
    base: dict[tuple[str, object], float] = {}
    for run, r, _ in results:
        if run.row.name == "llama.cpp --no-repack":
            rate = r.get("decode_tps") if "died" not in r else (r.get("partial") or {}).get(
                "decode_tps")
            if rate:
                base[(_threads(r, run), r.get("read_ahead_kb"))] = rate
    lru = {(_threads(r, run), r.get("read_ahead_kb")): r["decode_tps"]
           for run, r, _ in results if run.row.name == "lru" and "died" not in r}
    for run, r, _ in results:
        if run.row.kind != "managed" or "died" in r:
            continue
        key = (_threads(r, run), r.get("read_ahead_kb"))
        parts = []
        if base.get(key):
            parts.append(f"{r['decode_tps'] / base[key]:.2f}x llama.cpp --no-repack")
        if run.row.name != "lru" and lru.get(key):
            parts.append(f"{r['decode_tps'] / lru[key]:.2f}x lru")
        if parts:
            out.append(f"- {run.row.name}, threads {key[0]}, read-ahead {key[1]} KiB: "
                       + ", ".join(parts))
    return out
