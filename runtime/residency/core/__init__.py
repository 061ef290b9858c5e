"""The residency core: every per-access decision of one device (hit/miss, admission, victims
in the policy's total order, leases, prefetch, per-(pool, phase) counters).

Two implementations of one interface, ``DeviceCore``:
  ``CCore``    (native.py) the C core (residency_core.c): what the runtime and replay run;
  ``ReferenceCore`` (runtime/residency/reference/core.py) the slow Python reference of the same
                    rules, used only by tests, which compare the two on the same streams.

``CorePolicy`` is what both take: the config's policies for the three phases, resolved.
Both answer with the records below (``CoreAccess``, ``PoolStats``), never bare tuples.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from runtime.residency.policies.factory import offline_needs, policy_entry
from runtime.residency.types import AFFINITY_SOURCES, NEIGHBOUR_HISTORY, Phase  # noqa: F401


def _c_params(role: str, spec, cost) -> tuple[float, ...]:
    """A policy's C parameter block (its registry line's c_params): what its file reads."""
    kw, block = spec.kwargs(), policy_entry(role, spec.name).c_params
    return tuple(float(x) for x in (block(kw, cost) if callable(block) else
                                    [kw[p] for p in block]))

# counter order of the core (telemetry.PhaseCounters' fields, hits left out: derived)
COUNTERS = ("accesses", "misses", "demand_miss_bytes", "admissions", "admitted_bytes",
            "transient_uses", "transient_bytes", "evictions", "evicted_bytes", "prefetch_issued",
            "prefetch_issued_bytes", "prefetch_used_bytes", "prefetch_wasted_bytes",
            "transition_hits")



def history_ok(h: np.ndarray, n_moe: int, n_expert: int) -> bool:
    """A neighbour history the core can take: (tokens, n_moe, k) expert ids in [0, n_expert),
    each token's layer distinct, then only the pad -1 (routing profiles, warm starts)."""
    if h.ndim != 3 or h.shape[1] != n_moe or ((h < -1) | (h >= n_expert)).any():
        return False
    pad = h < 0
    if (pad[..., :-1] & ~pad[..., 1:]).any():      # an id after a pad
        return False
    rows = np.sort(h.reshape(-1, h.shape[2]), axis=1)
    return not ((rows[:, 1:] == rows[:, :-1]) & (rows[:, 1:] >= 0)).any()

# key states: 0..2 resident (the phase that admitted it), else absent
RESIDENT_MAX, ABSENT = 2, 8
NEVER = 2**62   # next_use value meaning "not used again"

# status codes (residency_core.h)
OK, ERR_LAYER, ERR_EXPERT, ERR_NEXT_USE, ERR_UPCOMING, ERR_NEXT_USE_LEN = 0, -1, -2, -3, -4, -5
ERR_POOL, ERR_CHARGED, ERR_STATE, ERR_NOMEM = -6, -7, -9, -10


class CoreError(Exception):
    """A core call refused (``status``: a code above; ``bad_value``: the offending layer or
    expert id for ERR_LAYER / ERR_EXPERT). A refused call changed nothing."""

    def __init__(self, status: int, bad_value: int = 0):
        super().__init__(f"residency core: status {status}")
        self.status = status
        self.bad_value = bad_value


class CoreAccess(NamedTuple):
    """What one core access (or prefetch) decided, flat keys (``layer * n_expert + expert``).

    A NamedTuple: built once per layer-step on the hot path (a frozen dataclass costs ~4x)."""

    hits: int
    misses: int                        # distinct missed keys
    transition_hits: int               # decode hits on keys admitted during prefill
    demand_miss_bytes: int
    admitted: tuple[int, ...]          # resident now, routing order
    evicted: tuple[int, ...]           # their victims, gone now
    transient: tuple[int, ...]         # used once without residency
    prefetched: tuple[tuple[int, tuple[int, ...]], ...]   # (key, its victims), issue order


@dataclass(frozen=True, slots=True)
class PoolStats:
    """One pool of a core at one instant (rc_pool_snapshot: taken under the core's lock)."""

    capacity: int                      # bytes; -1 unresolved
    resident_bytes: int
    resident_count: int
    counters: tuple[tuple[int, ...], ...]   # (3 phases, len(COUNTERS)), the core's order


@dataclass(frozen=True)
class CorePolicy:
    """The three phases' policies in the core's terms (see residency_core.h, rc_policy): each
    a name and its C parameter block (the registry's c_params: what its policy file reads,
    in order; the mechanism never reads them)."""

    orders: tuple[tuple[str, tuple[float, ...]], ...]   # distinct eviction specs
    phase_order: tuple[int, int, int]              # phase -> index into orders
    admission: tuple[tuple[str, tuple[float, ...]], ...]   # per phase
    prefetch: tuple[tuple[str, tuple[float, ...]], ...]    # per phase; MIXED none
    track_next_use: bool                           # an offline policy: accesses need next_use
    # experts per token (the bound model's): a prompt chunk's rows are token-major, this many
    # each, and prefetch affinity learns its pairs from them too; 0 unknown (decode only)
    n_expert_used: int = 0

    @classmethod
    def from_config(cls, config) -> CorePolicy:
        """From a ResidencyConfig (policies per phase; MIXED never prefetches)."""
        from runtime.errors import UserError  # noqa: PLC0415

        phases = [config.policies_for(p) for p in Phase]
        specs: list = []
        for pp in phases:
            if pp.eviction not in specs:
                specs.append(pp.eviction)
        cost = config.cost
        orders = tuple((spec.name, _c_params("eviction", spec, cost)) for spec in specs)
        admission = tuple((pp.admission.name, _c_params("admission", pp.admission, cost))
                          for pp in phases)
        prefetch = [(pp.prefetch.name, _c_params("prefetch", pp.prefetch, cost))
                    for pp in phases]
        prefetch[Phase.MIXED] = ("none", ())
        # a policy with one state of its own per core: the same parameters in every phase
        blocks: dict[tuple[str, str], set] = {}
        for role, (name, block) in [("eviction", o) for o in orders] + [
                ("prefetch", pf) for pf in prefetch[:Phase.MIXED]]:
            if policy_entry(role, name).one_model:
                blocks.setdefault((role, name), set()).add(block)
        for (role, name), values in blocks.items():
            if len(values) > 1:
                raise UserError(f"{config.source}: {role} policy {name!r} must have the same "
                                "parameters in every phase (it keeps one model)")
        return cls(orders=orders, phase_order=tuple(specs.index(pp.eviction) for pp in phases),
                   admission=admission, prefetch=tuple(prefetch),
                   track_next_use=offline_needs(phases)[0])

    def needs_upcoming(self, phase: int) -> bool:
        return policy_entry("prefetch", self.prefetch[phase][0]).offline
