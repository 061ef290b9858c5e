"""Residency counters: frozen snapshots of the core's per-(pool, phase) counters.

A snapshot renders as a dict, JSON, or Prometheus text exposition format (``moe_expert_*``
families; counters carry ``device`` and ``phase`` labels, gauges ``device``; the pool
families ``moe_expert_pool_*`` carry ``device`` and ``pool``). ``hits`` is derived
(accesses - misses: every access is a hit or a distinct-key miss). ``snapshot(experts=True)``
adds each device's ``ExpertMap``: every expert's state and access count.
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
class PoolSnapshot:
    """One pool of a device: layers sharing a capacity (one expert layout in the device cache)."""

    layers: tuple[int, ...]
    capacity_bytes: int | None       # None: not resolved yet
    resident_bytes: int
    resident_experts: int
    phases: tuple[PhaseCounters, ...]  # indexed by Phase

    def to_dict(self) -> dict:
        return {"layers": list(self.layers), "capacity_bytes": self.capacity_bytes,
                "resident_bytes": self.resident_bytes,
                "resident_experts": self.resident_experts,
                "phases": {p.label: asdict(self.phases[p]) for p in Phase}}


# ExpertMap.state: one character per expert (a decision takes effect at once: an expert is
# resident from its admission on)
STATE_CHARS = {"resident": "R", "absent": "-"}


@dataclass(frozen=True, slots=True)
class ExpertMap:
    """Where each routed expert stands on one device and how often it was routed: the
    (layer, expert) view behind the chat page's heat map, compact as JSON (a string of state
    characters and a list of counts per MoE layer)."""

    layers: tuple[int, ...]               # the model's MoE layers, in row order
    state: tuple[str, ...]                # per layer one char per expert (STATE_CHARS)
    routed: tuple[tuple[int, ...], ...]   # (n_moe_layers, n_expert) accesses, every phase

    def to_dict(self) -> dict:
        return {"layers": list(self.layers), "state": list(self.state),
                "routed": [list(row) for row in self.routed]}


@dataclass(frozen=True, slots=True)
class DeviceSnapshot:
    device: str
    capacity_bytes: int | None       # None: not resolved yet (see note)
    resident_bytes: int
    resident_experts: int
    phases: tuple[PhaseCounters, ...]  # indexed by Phase
    note: str = ""
    static_bytes: int | None = None  # pinned by pin_static (static device); None: not static
    pools: tuple[PoolSnapshot, ...] = ()
    experts: ExpertMap | None = None  # only in snapshot(experts=True)

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
                "note": d.note,
                "static_bytes": d.static_bytes,
                "phases": {p.label: asdict(d.phases[p]) for p in Phase},
                "pools": [pool.to_dict() for pool in d.pools],
            }
            if d.experts is not None:
                out[d.device]["experts"] = d.experts.to_dict()
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
        pool_gauges = {"capacity_bytes": "Expert budget of one pool of a device.",
                       "resident_bytes": "Bytes of experts resident in one pool of a device.",
                       "resident_experts": "Experts resident in one pool of a device."}
        for name, helptext in pool_gauges.items():
            family = f"moe_expert_pool_{name}"
            lines.append(f"# HELP {family} {helptext}")
            lines.append(f"# TYPE {family} gauge")
            for d in self.devices:
                for i, pool in enumerate(d.pools):
                    value = getattr(pool, name)
                    if value is not None:
                        lines.append(f'{family}{{device="{_escape(d.device)}",pool="{i}"}} '
                                     f"{value}")
        for name in ("misses", "evictions"):
            family = f"moe_expert_pool_{name}_total"
            lines.append(f"# HELP {family} {COUNTER_HELP[name]} Per pool.")
            lines.append(f"# TYPE {family} counter")
            for d in self.devices:
                for i, pool in enumerate(d.pools):
                    for p in Phase:
                        lines.append(f'{family}{{device="{_escape(d.device)}",pool="{i}",'
                                     f'phase="{p.label}"}} {getattr(pool.phases[p], name)}')
        return "\n".join(lines) + "\n"


def _escape(label: str) -> str:
    return label.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
