"""Residency counters: mutable per-phase tallies inside the manager, frozen snapshots outside.

A snapshot renders as a dict, JSON, or Prometheus text exposition format (``moe_expert_*``
families; counters carry ``device`` and ``phase`` labels, gauges ``device``).
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields

from runtime.residency.types import Phase

COUNTER_HELP = {
    "accesses": "Routed expert accesses (one per token, layer and slot).",
    "hits": "Accesses served by a resident expert.",
    "misses": "Distinct experts missing at their layer-step (demand misses).",
    "demand_miss_bytes": "Bytes of demand-missed experts (I/O on the critical path).",
    "admissions": "Experts made resident by demand admission.",
    "admitted_bytes": "Bytes made resident by demand admission.",
    "transient_uses": "Demand misses used once without becoming resident.",
    "transient_bytes": "Bytes of transiently used experts.",
    "evictions": "Experts evicted.",
    "evicted_bytes": "Bytes evicted.",
    "prefetch_issued": "Prefetch transfers issued.",
    "prefetch_issued_bytes": "Bytes of prefetch transfers issued.",
    "prefetch_used_bytes": "Bytes of prefetched experts hit before eviction.",
    "prefetch_wasted_bytes": "Bytes of prefetched experts evicted (or aborted) unused.",
    "transition_hits": "Decode hits on experts admitted during prefill.",
}


class PhaseTally:
    """Mutable counters of one (device, phase); only the manager touches them, under its lock.

    ``hits`` is not kept: every access is a hit or a (distinct-key) miss, so
    hits == accesses - misses (one counter less to update per call)."""

    __slots__ = tuple(name for name in COUNTER_HELP if name != "hits")

    def __init__(self) -> None:
        for name in self.__slots__:
            setattr(self, name, 0)

    def freeze(self) -> PhaseCounters:
        values = {name: getattr(self, name) for name in self.__slots__}
        return PhaseCounters(hits=self.accesses - self.misses, **values)


@dataclass(frozen=True, slots=True)
class PhaseCounters:
    accesses: int = 0
    hits: int = 0
    misses: int = 0
    demand_miss_bytes: int = 0
    admissions: int = 0
    admitted_bytes: int = 0
    transient_uses: int = 0
    transient_bytes: int = 0
    evictions: int = 0
    evicted_bytes: int = 0
    prefetch_issued: int = 0
    prefetch_issued_bytes: int = 0
    prefetch_used_bytes: int = 0
    prefetch_wasted_bytes: int = 0
    transition_hits: int = 0

    def __add__(self, other: PhaseCounters) -> PhaseCounters:
        return PhaseCounters(*(getattr(self, f.name) + getattr(other, f.name)
                               for f in fields(self)))


@dataclass(frozen=True, slots=True)
class DeviceSnapshot:
    device: str
    capacity_bytes: int | None       # None: not resolved yet (see note)
    resident_bytes: int
    resident_experts: int
    pending_tickets: int
    pending_bytes: int               # bytes claimed by transfers in flight
    phases: tuple[PhaseCounters, ...]  # indexed by Phase
    note: str = ""
    static_bytes: int | None = None  # pinned by pin_static (static device); None: not static

    def phase(self, phase: Phase) -> PhaseCounters:
        return self.phases[int(phase)]

    @property
    def total(self) -> PhaseCounters:
        out = PhaseCounters()
        for counters in self.phases:
            out = out + counters
        return out


@dataclass(frozen=True, slots=True)
class ResidencySnapshot:
    devices: tuple[DeviceSnapshot, ...]

    def device(self, name: str) -> DeviceSnapshot:
        for d in self.devices:
            if d.device == name:
                return d
        raise KeyError(name)

    def to_dict(self) -> dict:
        out = {}
        for d in self.devices:
            out[d.device] = {
                "capacity_bytes": d.capacity_bytes,
                "resident_bytes": d.resident_bytes,
                "resident_experts": d.resident_experts,
                "pending_tickets": d.pending_tickets,
                "pending_bytes": d.pending_bytes,
                "note": d.note,
                "static_bytes": d.static_bytes,
                "phases": {p.label: asdict(d.phases[p]) for p in Phase},
            }
        return {"devices": out}

    def to_json(self, indent: int | None = None) -> str:
        return json.dumps(self.to_dict(), indent=indent, sort_keys=True)

    def to_prometheus(self) -> str:
        """Prometheus text exposition format (version 0.0.4)."""
        lines: list[str] = []
        for name, helptext in COUNTER_HELP.items():
            family = f"moe_expert_{name}_total"
            lines.append(f"# HELP {family} {helptext}")
            lines.append(f"# TYPE {family} counter")
            for d in self.devices:
                for p in Phase:
                    value = getattr(d.phases[p], name)
                    lines.append(f'{family}{{device="{_escape(d.device)}",phase="{p.label}"}} '
                                 f"{value}")
        gauges = {
            "resident_bytes": ("Bytes of experts resident on the device.", "resident_bytes"),
            "resident_experts": ("Experts resident on the device.", "resident_experts"),
            "pending_bytes": ("Bytes claimed by transfers in flight.", "pending_bytes"),
            "capacity_bytes": ("Expert budget of the device (absent until resolved).",
                               "capacity_bytes"),
            "static_bytes": ("Bytes of experts pinned on a static device (absent if not "
                             "static).", "static_bytes"),
        }
        for name, (helptext, attr) in gauges.items():
            family = f"moe_expert_{name}"
            lines.append(f"# HELP {family} {helptext}")
            lines.append(f"# TYPE {family} gauge")
            for d in self.devices:
                value = getattr(d, attr)
                if value is not None:
                    lines.append(f'{family}{{device="{_escape(d.device)}"}} {value}')
        return "\n".join(lines) + "\n"


def _escape(label: str) -> str:
    return label.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
