"""The replay matrix as markdown: per trace, policy rows x capacity columns.

The headline table gives decode demand-miss MiB per decode token and its ratio to the Belady
ceiling of the same cell (late prefetches count as demand misses: runtime/replay/timing.py);
a detail table lists every counter that went into it, and the bytes moved in all.
"""
from __future__ import annotations

from runtime.replay.harness import CellResult
from runtime.units import format_size

MIB = float(1 << 20)


def _ordered(values):
    return list(dict.fromkeys(values))


def _ratio(value: int, ceiling: int) -> str:
    if ceiling == 0:
        return "1.00x" if value == 0 else "inf"
    return f"{value / ceiling:.2f}x"


def _mib(n: int | None) -> str:
    return "-" if n is None else f"{n / MIB:,.0f}"


def matrix_markdown(cells: list[CellResult], *, html: bool = True) -> str:
    """Markdown for every trace in ``cells`` (in first-seen order); ``html=False``: the
    detail table under a plain heading instead of a ``<details>`` fold (for a terminal)."""
    out = []
    for trace in _ordered(c.trace for c in cells):
        out.append(trace_markdown([c for c in cells if c.trace == trace], html=html))
    return "\n".join(out)


def trace_markdown(cells: list[CellResult], *, html: bool = True) -> str:
    """Headline and detail tables of one trace's cells."""
    first = cells[0]
    caps = _ordered((c.capacity_bytes, c.capacity_label) for c in cells)
    policies = _ordered(c.policy for c in cells)
    by = {(c.policy, c.capacity_bytes): c for c in cells}
    tokens = max(first.decode_tokens, 1)
    lines = [f"### {first.trace}", "",
             f"Decode demand-miss MiB per token (ratio to Belady), {first.decode_tokens} decode "
             f"tokens; cold-miss floor {first.cold_miss_bytes / MIB:,.0f} MiB (all phases).", ""]
    head = ["policy"] + [f"{label} ({format_size(b)})" if label != str(b) else format_size(b)
                         for b, label in caps]
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    ceilings = {c.capacity_bytes: c.belady_decode_demand_miss_bytes for c in cells
                if c.belady_decode_demand_miss_bytes is not None}
    for policy in policies:
        cols = [policy]
        for b, _ in caps:
            c = by.get((policy, b))
            if c is None:
                cols.append("-")
                continue
            ceiling = ceilings.get(b)
            ratio = "" if ceiling is None else f" ({_ratio(c.decode.demand_miss_bytes, ceiling)})"
            cols.append(f"{c.decode.demand_miss_bytes / MIB / tokens:,.1f}{ratio}")
        lines.append("| " + " | ".join(cols) + " |")
    if ceilings and "belady" not in policies:
        cols = ["belady (ceiling)"] + [
            "-" if ceilings.get(b) is None else f"{ceilings[b] / MIB / tokens:,.1f} (1.00x)"
            for b, _ in caps]
        lines.append("| " + " | ".join(cols) + " |")
    lines += ["", "<details><summary>all counters</summary>" if html else "All counters:", "",
              "| policy | capacity | prefill MiB | decode MiB | decode hit rate | "
              "prefetch issued / used / late / wasted MiB | moved MiB | transient uses | "
              "Belady MiB | est TTFT s | est TPOT ms |",
              "|---|---|---|---|---|---|---|---|---|---|---|"]
    for c in cells:
        pf = [c.prefill.prefetch_issued_bytes + c.decode.prefetch_issued_bytes,
              c.prefill.prefetch_used_bytes + c.decode.prefetch_used_bytes,
              c.prefill.prefetch_late_bytes + c.decode.prefetch_late_bytes,
              c.prefill.prefetch_wasted_bytes + c.decode.prefetch_wasted_bytes]
        moved = c.prefill.bytes_moved + c.decode.bytes_moved
        lines.append(
            f"| {c.policy} | {c.capacity_label} | {c.prefill.demand_miss_bytes / MIB:,.0f} | "
            f"{c.decode.demand_miss_bytes / MIB:,.0f} | {c.decode.hit_rate:.3f} | "
            f"{' / '.join(f'{x / MIB:,.0f}' for x in pf)} | {moved / MIB:,.0f} | "
            f"{c.prefill.transient_uses + c.decode.transient_uses:,} | "
            f"{_mib(c.belady_demand_miss_bytes)} | {c.est_ttft_s:.3f} | "
            f"{c.est_tpot_s * 1e3:.2f} |")
    lines += ["", "</details>", ""] if html else [""]
    return "\n".join(lines)
