"""What the RAM tier reports: its counters, and residency as the manager and mincore see it."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class TierStats:
    """Counters since attach (bytes, seconds)."""

    routes: int
    paged_in_bytes: int          # read on demand before a matmul: misses + reclaimed hits
    reclaimed_hit_bytes: int     # part of the above: manager hits the kernel had dropped
    page_in_seconds: float       # time the hook waited for reads
    prefetched_bytes: int        # read by prefetch tickets, off the critical path
    dropped_experts: int
    locked_bytes: int
    read_errors: int
    refilled_bytes: int = 0      # read back in the background after a cold cache
    one_use_peak_bytes: int = 0  # most one-use reads + queued drops at a layer-step's reads
    drop_wait_seconds: float = 0.0   # layer-steps on queued drops (to keep within the room)


@dataclass(frozen=True, slots=True)
class ResidencyTruth:
    """The manager's view and ``mincore``'s side by side (bytes of routed experts in RAM).

    mincore sees the page cache, which is shared: pages another process read from the same
    file count too."""

    manager_resident_bytes: int  # experts the manager counts as resident on ``cpu``
    mincore_resident_bytes: int  # expert bytes whose pages the page cache holds now
    budget_bytes: int

    def to_dict(self) -> dict[str, int]:
        return {"manager_resident_bytes": self.manager_resident_bytes,
                "mincore_resident_bytes": self.mincore_resident_bytes,
                "budget_bytes": self.budget_bytes}


def prometheus_text(truth: ResidencyTruth, st: TierStats) -> str:
    """Prometheus text exposition: ``moe_ramtier_resident_bytes{view="manager"|"mincore"}``,
    budget and locked bytes (gauges), and the tier's counters (``*_total``)."""
    lines = [
        "# HELP moe_ramtier_resident_bytes Expert bytes in host RAM: the manager's view "
        "and mincore's.",
        "# TYPE moe_ramtier_resident_bytes gauge",
        f'moe_ramtier_resident_bytes{{view="manager"}} {truth.manager_resident_bytes}',
        f'moe_ramtier_resident_bytes{{view="mincore"}} {truth.mincore_resident_bytes}',
        "# TYPE moe_ramtier_budget_bytes gauge",
        f"moe_ramtier_budget_bytes {truth.budget_bytes}",
        "# TYPE moe_ramtier_locked_bytes gauge",
        f"moe_ramtier_locked_bytes {st.locked_bytes}",
        "# TYPE moe_ramtier_one_use_peak_bytes gauge",
        f"moe_ramtier_one_use_peak_bytes {st.one_use_peak_bytes}",
    ]
    for name, value in (("paged_in_bytes", st.paged_in_bytes),
                        ("reclaimed_hit_bytes", st.reclaimed_hit_bytes),
                        ("prefetched_bytes", st.prefetched_bytes),
                        ("refilled_bytes", st.refilled_bytes),
                        ("page_in_seconds", round(st.page_in_seconds, 6)),
                        ("drop_wait_seconds", round(st.drop_wait_seconds, 6)),
                        ("dropped_experts", st.dropped_experts),
                        ("read_errors", st.read_errors)):
        lines += [f"# TYPE moe_ramtier_{name}_total counter",
                  f"moe_ramtier_{name}_total {value}"]
    return "\n".join(lines) + "\n"

