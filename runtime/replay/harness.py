"""Replay a routing trace through the residency manager in simulated mode.

The manager is the one the runtime uses (``ExpertResidencyManager.create_simulated``); this
module only feeds it: one ``access_layer`` per layer batch (``RouteTrace.batch_bounds``) with
``lease=False``: the experts of a layer-step hold their leases for the call, which in replay is
the whole layer-step (the same as ``release`` right after it).
Offline policies get what they need from the trace's future: ``next_use`` for eviction
``belady`` / admission ``belady-bypass``, ``upcoming`` (the next layer-step) for prefetch
``belady``. Results come from the manager's own counters (``snapshot()``).

    prep = prepare(read_trace("t.csv"), name="t.csv")
    cell = replay_cell(prep, 2 << 30, preset_config("lru"), label="lru")
"""
from __future__ import annotations

import gc
from dataclasses import dataclass, field, replace

import numpy as np

from runtime.replay.belady import BoundResult, belady_ceiling, cold_miss_bytes, next_use
from runtime.replay.cost_model import CostModel
from runtime.residency.config import ResidencyConfig
from runtime.residency.manager import ExpertResidencyManager
from runtime.residency.types import Phase, UpcomingStep
from runtime.traces.trace import PHASE_PREFILL, RouteTrace

DEVICE = "sim"
PHASES = (Phase.PREFILL, Phase.DECODE, Phase.MIXED)


@dataclass
class PreparedTrace:
    """A trace cut into layer batches once; every cell of a replay matrix reuses it."""

    name: str
    trace: RouteTrace
    starts: list[int]            # (n_batches,) first row of each layer batch
    stops: list[int]             # (n_batches,) one past its last row
    layers: list[int]            # (n_batches,)
    phases: list[Phase]          # (n_batches,)
    steps: list[int]             # (n_batches,) step of the batch's first token
    multi_token: list[bool]      # (n_batches,) more than one token (prefill chunks)
    experts: np.ndarray          # (n,) int64 expert id per row, routing order
    cold_miss_bytes: int
    prefill_turns: int           # turns that have prefill rows
    decode_tokens: int           # decode (and mixed) tokens
    runs: int = 0                # manager runs so far (one per cell)
    _next_use: np.ndarray | None = field(default=None, repr=False)
    _next_use_list: list[int] | None = field(default=None, repr=False)
    _expert_list: list[int] | None = field(default=None, repr=False)
    _ceilings: dict[int, BoundResult] = field(default_factory=dict, repr=False)

    @property
    def accesses(self) -> int:
        return len(self.trace)

    def next_use(self) -> np.ndarray:
        """(n,) int64 index of each access's next use of the same key (``belady.NEVER``)."""
        if self._next_use is None:
            self._next_use = next_use(self.trace)
        return self._next_use

    def ceiling(self, capacity_bytes: int) -> BoundResult:
        """The Belady ceiling (eviction by next use, with bypass) at ``capacity_bytes``."""
        found = self._ceilings.get(capacity_bytes)
        if found is None:
            found = belady_ceiling(self.trace, capacity_bytes, self.next_use())
            self._ceilings[capacity_bytes] = found
        return found

    def next_use_list(self) -> list[int]:
        if self._next_use_list is None:
            self._next_use_list = self.next_use().tolist()
        return self._next_use_list

    def expert_list(self) -> list[int]:
        """The experts column as a Python list (the manager takes list slices fastest)."""
        if self._expert_list is None:
            self._expert_list = self.experts.tolist()
        return self._expert_list


def prepare(trace: RouteTrace, name: str | None = None) -> PreparedTrace:
    """Cut ``trace`` into layer batches and gather the per-trace facts cells share."""
    bounds = trace.batch_bounds()
    starts = bounds[:-1]
    k = trace.header.n_expert_used
    sizes = np.diff(bounds)
    multi = sizes > k
    t = trace
    prefill_turns = len(np.unique(t.turn[t.phase == PHASE_PREFILL]))
    decode_tokens = t.token_count(1) + t.token_count(2)
    return PreparedTrace(
        name=name or trace.source, trace=trace, starts=starts.tolist(),
        stops=bounds[1:].tolist(), layers=t.layer[starts].tolist(),
        phases=[PHASES[p] for p in t.phase[starts].tolist()], steps=t.step[starts].tolist(),
        multi_token=multi.tolist(), experts=t.expert.astype(np.int64),
        cold_miss_bytes=cold_miss_bytes(t), prefill_turns=prefill_turns,
        decode_tokens=decode_tokens)


@dataclass(frozen=True)
class PhaseResult:
    """One phase of one cell, from the manager's counters."""

    accesses: int
    hits: int
    misses: int
    demand_miss_bytes: int
    prefetch_issued_bytes: int
    prefetch_used_bytes: int
    prefetch_wasted_bytes: int
    transient_uses: int
    admissions: int
    evictions: int

    @property
    def hit_rate(self) -> float:
        return self.hits / self.accesses if self.accesses else 0.0

    def to_json(self) -> dict:
        return {
            "accesses": self.accesses, "hits": self.hits, "misses": self.misses,
            "hit_rate": round(self.hit_rate, 6), "demand_miss_bytes": self.demand_miss_bytes,
            "prefetch_issued_bytes": self.prefetch_issued_bytes,
            "prefetch_used_bytes": self.prefetch_used_bytes,
            "prefetch_wasted_bytes": self.prefetch_wasted_bytes,
            "transient_uses": self.transient_uses, "admissions": self.admissions,
            "evictions": self.evictions,
        }

    @classmethod
    def from_counters(cls, c) -> PhaseResult:
        return cls(accesses=c.accesses, hits=c.hits, misses=c.misses,
                   demand_miss_bytes=c.demand_miss_bytes,
                   prefetch_issued_bytes=c.prefetch_issued_bytes,
                   prefetch_used_bytes=c.prefetch_used_bytes,
                   prefetch_wasted_bytes=c.prefetch_wasted_bytes,
                   transient_uses=c.transient_uses, admissions=c.admissions,
                   evictions=c.evictions)


@dataclass(frozen=True)
class CellResult:
    """One trace x capacity x policy cell."""

    trace: str
    policy: str
    capacity_bytes: int
    capacity_label: str          # as the user wrote it ("20%", "6GiB")
    prefill: PhaseResult
    decode: PhaseResult          # decode and mixed batches together
    decode_tokens: int
    cold_miss_bytes: int
    est_ttft_s: float
    est_tpot_s: float
    # the Belady ceiling of the same trace and capacity (belady.belady_ceiling); None: not run
    belady_prefill_demand_miss_bytes: int | None = None
    belady_decode_demand_miss_bytes: int | None = None

    @property
    def demand_miss_bytes(self) -> int:
        return self.prefill.demand_miss_bytes + self.decode.demand_miss_bytes

    @property
    def belady_demand_miss_bytes(self) -> int | None:
        if self.belady_decode_demand_miss_bytes is None:
            return None
        return self.belady_prefill_demand_miss_bytes + self.belady_decode_demand_miss_bytes

    def to_json(self) -> dict:
        return {
            "trace": self.trace, "policy": self.policy, "capacity_bytes": self.capacity_bytes,
            "capacity": self.capacity_label,
            "prefill": self.prefill.to_json(), "decode": self.decode.to_json(),
            "total": _sum_phases(self.prefill, self.decode).to_json(),
            "demand_miss_bytes": self.demand_miss_bytes,
            "decode_tokens": self.decode_tokens,
            "cold_miss_bytes": self.cold_miss_bytes,
            "belady_demand_miss_bytes": self.belady_demand_miss_bytes,
            "belady_decode_demand_miss_bytes": self.belady_decode_demand_miss_bytes,
            "est_ttft_s": self.est_ttft_s, "est_tpot_s": self.est_tpot_s,
        }


def offline_needs(config: ResidencyConfig) -> tuple[bool, bool]:
    """(needs next_use, needs upcoming) for the policies ``config`` names in any phase."""
    nxt = upcoming = False
    for phase in PHASES:
        pol = config.policies_for(phase)
        nxt |= pol.eviction.name == "belady" or pol.admission.name == "belady-bypass"
        upcoming |= pol.prefetch.name == "belady"
    return nxt, upcoming


def replay_cell(prep: PreparedTrace, capacity_bytes: int, config: ResidencyConfig, *,
                label: str, capacity_label: str = "", with_belady: bool = True) -> CellResult:
    """Replay ``prep`` through a simulated manager; with the Belady ceiling when asked.

    The ceiling comes from ``belady.belady_ceiling``, an offline loop written apart from the
    manager that makes the same decisions as the manager's ``belady`` policy (eviction belady,
    admission belady-bypass; tests compare them on real traces) at a fraction of the cost.
    """
    cell = _run(prep, capacity_bytes, config, label, capacity_label)
    if not with_belady:
        return cell
    ceiling = prep.ceiling(capacity_bytes)
    return replace(cell, belady_prefill_demand_miss_bytes=ceiling.demand_miss_bytes[0],
                   belady_decode_demand_miss_bytes=ceiling.demand_miss_bytes[1])


def _run(prep: PreparedTrace, capacity_bytes: int, config: ResidencyConfig, label: str,
         capacity_label: str) -> CellResult:
    h = prep.trace.header
    prep.runs += 1
    mgr = ExpertResidencyManager.create_simulated(
        expert_bytes=h.expert_bytes, n_expert=h.n_expert, capacity_bytes=capacity_bytes,
        config=config, device=DEVICE)
    accesses = _drive(mgr, prep, *offline_needs(config))
    cost = CostModel(config.cost, h.expert_bytes, h.dense_bytes)
    _price(cost, prep, accesses)
    snap = mgr.snapshot().device(DEVICE)
    for phase in PHASES:
        cost.add_prefetch_bytes(phase, snap.phase(phase).prefetch_issued_bytes)
    ttft, tpot = cost.estimate(prefill_turns=prep.prefill_turns,
                               decode_tokens=prep.decode_tokens)
    prefill = PhaseResult.from_counters(snap.phase(Phase.PREFILL))
    decode = _sum_phases(PhaseResult.from_counters(snap.phase(Phase.DECODE)),
                         PhaseResult.from_counters(snap.phase(Phase.MIXED)))
    return CellResult(trace=prep.name, policy=label, capacity_bytes=capacity_bytes,
                      capacity_label=capacity_label or str(capacity_bytes), prefill=prefill,
                      decode=decode, decode_tokens=prep.decode_tokens,
                      cold_miss_bytes=prep.cold_miss_bytes, est_ttft_s=ttft, est_tpot_s=tpot)


def _drive(mgr: ExpertResidencyManager, prep: PreparedTrace, needs_next: bool,
           needs_upcoming: bool) -> list:
    """One ``access_layer`` per layer batch, in order; the accesses.

    The cyclic garbage collector is paused meanwhile: the loop allocates ~10 small acyclic
    objects per batch (freed by reference counting), which would trigger a full collection
    pass every few hundred batches for nothing (~15 % of the loop).
    """
    enabled = gc.isenabled()
    gc.disable()
    try:
        return _drive_loop(mgr, prep, needs_next, needs_upcoming)
    finally:
        if enabled:
            gc.enable()


def _drive_loop(mgr: ExpertResidencyManager, prep: PreparedTrace, needs_next: bool,
                needs_upcoming: bool) -> list:
    access = mgr.access_layer
    experts, starts, stops = prep.expert_list(), prep.starts, prep.stops
    layers, phases, steps = prep.layers, prep.phases, prep.steps
    n_batches = len(starts)
    out = [None] * n_batches
    # lease=False: the manager holds the batch's leases for the call only, which in replay
    # is the whole layer-step (the next call is the next layer-step)
    if not needs_next and not needs_upcoming:      # the common case, kept tight
        for b in range(n_batches):
            out[b] = access(DEVICE, layers[b], experts[starts[b]:stops[b]], phases[b],
                            step=steps[b], lease=False)
        return out
    nxt = prep.next_use_list() if needs_next else None
    arr = prep.experts
    for b in range(n_batches):
        s, e = starts[b], stops[b]
        kwargs = {}
        if nxt is not None:
            kwargs["next_use"] = nxt[s:e]
        if needs_upcoming:                         # the next layer-step (none after the last)
            nb = min(b + 1, n_batches - 1)
            s2, e2 = (starts[nb], stops[nb]) if b + 1 < n_batches else (e, e)
            kwargs["upcoming"] = UpcomingStep(layer=layers[nb], experts=arr[s2:e2],
                                              access_index=np.arange(s2, e2, dtype=np.int64))
        out[b] = access(DEVICE, layers[b], experts[s:e], phases[b], step=steps[b],
                        lease=False, **kwargs)
    return out


def _price(cost: CostModel, prep: PreparedTrace, accesses: list) -> None:
    """Feed the cost model: multi-token batches one by one, one-token batches summed per layer."""
    n_layer = len(cost.expert_bytes)
    multi = prep.multi_token
    single = [b for b in range(len(accesses)) if not multi[b]]
    for b in range(len(accesses)):
        if multi[b]:
            s, e = prep.starts[b], prep.stops[b]
            _price_batch(cost, prep.phases[b], prep.layers[b], prep.experts[s:e], accesses[b],
                         prep.trace.header.n_expert_used)
    if not single:
        return
    layer = np.asarray([prep.layers[b] for b in single], dtype=np.int64)
    phase = np.asarray([int(prep.phases[b]) for b in single], dtype=np.int64)
    hits = np.asarray([accesses[b].hits for b in single], dtype=np.float64)
    misses = np.asarray([accesses[b].misses for b in single], dtype=np.float64)
    admitted = np.asarray([len(accesses[b].admitted) for b in single], dtype=np.float64)
    for ph in PHASES:
        m = phase == int(ph)
        if m.any():
            per_layer = [np.bincount(layer[m], weights=w[m], minlength=n_layer)
                         for w in (hits, misses, admitted, np.ones(len(layer)))]
            cost.add_single_token_counts(int(ph), *per_layer)


def _price_batch(cost: CostModel, phase: Phase, layer: int, experts: np.ndarray, acc,
                 k: int) -> None:
    keys, tokens = np.unique(experts, return_counts=True)
    missed_ids = {key.expert for key in acc.admitted + acc.transient if key.layer == layer}
    admitted_ids = {key.expert for key in acc.admitted if key.layer == layer}
    ids = keys.tolist()
    missed = np.fromiter((x in missed_ids for x in ids), dtype=bool, count=len(ids))
    admitted = np.fromiter((x in admitted_ids for x in ids), dtype=bool, count=len(ids))
    cost.add_batch_call(int(phase), layer, len(experts) // k, tokens, missed, admitted)


def _sum_phases(a: PhaseResult, b: PhaseResult) -> PhaseResult:
    return PhaseResult(**{name: getattr(a, name) + getattr(b, name)
                          for name in a.__dataclass_fields__})
