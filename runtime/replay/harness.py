"""Replay a routing trace through the residency manager in simulated mode.

The manager is the one the runtime uses (``ExpertResidencyManager.create_simulated``, the same
residency core); this module only feeds it: every layer batch (``RouteTrace.batch_bounds``) as
one access in order, without leases (the experts of a layer-step are protected for the call,
which in replay is the whole layer-step), through ``manager.replay`` (the core's own loop over
the batches: the same access as ``access_layer``, without a Python call per batch).
Offline policies get what they need from the trace's future: ``next_use`` for eviction
``belady`` / admission ``belady-bypass``, ``upcoming`` (the next layer-step) for prefetch
``belady``. Results come from the manager's own counters (``snapshot()``).

    prep = prepare(read_trace("t.csv"), name="t.csv")
    cell = replay_cell(prep, 2 << 30, preset_config("lru"), label="lru")
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np

from runtime.replay.belady import BoundResult, cold_miss_bytes, next_use
from runtime.replay.cost_model import CostModel
from runtime.replay.timing import PrefetchTiming, prefetch_timing
from runtime.residency.config import ResidencyConfig, preset_config
from runtime.errors import UserError
from runtime.residency.manager import ExpertResidencyManager, PoolSpec
from runtime.residency.policies.factory import offline_needs as policy_offline_needs
from runtime.residency.types import Phase
from runtime.traces.trace import PHASE_PREFILL, RouteTrace

DEVICE = "sim"
PHASES = (Phase.PREFILL, Phase.DECODE, Phase.MIXED)


@dataclass
class PreparedTrace:
    """A trace cut into layer batches once; every cell of a replay matrix reuses it."""

    name: str
    trace: RouteTrace
    bounds: np.ndarray           # (n_batches + 1,) int64 row offsets of the layer batches
    layer_arr: np.ndarray        # (n_batches,) int32 layer of each batch
    phase_arr: np.ndarray        # (n_batches,) int8 phase of each batch
    multi_token: np.ndarray      # (n_batches,) bool: more than one token (prefill chunks)
    experts: np.ndarray          # (n,) int64 expert id per row, routing order
    expert_i32: np.ndarray       # (n,) the same as the core takes them
    cold_miss_bytes: int
    prefill_turns: int           # turns that have prefill rows
    decode_tokens: int           # decode (and mixed) tokens
    runs: int = 0                # manager runs so far (one per cell)
    _next_use: np.ndarray | None = field(default=None, repr=False)
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
        """The Belady ceiling (eviction by next use, with bypass) at ``capacity_bytes``: the
        manager's ``belady`` preset through the core (tests hold it equal to belady.py's
        independent loop, ``belady_ceiling``)."""
        found = self._ceilings.get(capacity_bytes)
        if found is None:
            cell = _run(self, capacity_bytes, preset_config("belady"), "belady", "")
            found = BoundResult(
                misses=(cell.prefill.misses, cell.decode.misses),
                demand_miss_bytes=(cell.prefill.demand_miss_bytes,
                                   cell.decode.demand_miss_bytes),
                transient=(cell.prefill.transient_uses, cell.decode.transient_uses))
            self._ceilings[capacity_bytes] = found
        return found


def prepare(trace: RouteTrace, name: str | None = None) -> PreparedTrace:
    """Cut ``trace`` into layer batches and gather the per-trace facts cells share."""
    bounds = trace.batch_bounds().astype(np.int64)
    starts = bounds[:-1]
    t = trace
    prefill_turns = len(np.unique(t.turn[t.phase == PHASE_PREFILL]))
    decode_tokens = t.token_count(1) + t.token_count(2)
    experts = t.expert.astype(np.int64)
    return PreparedTrace(
        name=name or trace.source, trace=trace, bounds=bounds,
        layer_arr=t.layer[starts].astype(np.int32), phase_arr=t.phase[starts].astype(np.int8),
        multi_token=np.diff(bounds) > t.header.n_expert_used, experts=experts,
        expert_i32=experts.astype(np.int32), cold_miss_bytes=cold_miss_bytes(t),
        prefill_turns=prefill_turns, decode_tokens=decode_tokens)


@dataclass(frozen=True)
class PhaseResult:
    """One phase of one cell, from the manager's counters with honest prefetch timing
    (runtime/replay/timing.py): a prefetch that arrived after its first use is a demand miss
    of the phase that used it (in ``misses`` and ``demand_miss_bytes``, and in
    ``prefetch_late_bytes``), not a hit. ``prefetch_used_bytes`` counts prefetches used in
    time; every prefetched byte used neither in time nor late is wasted (evicted unused or
    still unused at the end), never a saving."""

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
    prefetch_late_bytes: int = 0

    @property
    def bytes_moved(self) -> int:
        """Every byte moved: demand misses (a late prefetch's bytes once) and prefetches."""
        return self.demand_miss_bytes + self.prefetch_issued_bytes - self.prefetch_late_bytes

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
            "prefetch_late_bytes": self.prefetch_late_bytes, "bytes_moved": self.bytes_moved,
            "transient_uses": self.transient_uses, "admissions": self.admissions,
            "evictions": self.evictions,
        }

    @classmethod
    def from_counters(cls, c, late: int = 0, late_bytes: int = 0,
                      wasted_bytes: int | None = None) -> PhaseResult:
        """From the manager's PhaseCounters; ``late`` / ``late_bytes``: the phase's late
        prefetches; ``wasted_bytes``: the phase's prefetched bytes never used (None: the
        core's count, those evicted unused)."""
        return cls(accesses=c.accesses, hits=c.hits - late, misses=c.misses + late,
                   demand_miss_bytes=c.demand_miss_bytes + late_bytes,
                   prefetch_issued_bytes=c.prefetch_issued_bytes,
                   prefetch_used_bytes=c.prefetch_used_bytes - late_bytes,
                   prefetch_wasted_bytes=(c.prefetch_wasted_bytes if wasted_bytes is None
                                          else wasted_bytes),
                   transient_uses=c.transient_uses, admissions=c.admissions,
                   evictions=c.evictions, prefetch_late_bytes=late_bytes)


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
    # the Belady ceiling of the same trace and capacity (PreparedTrace.ceiling); None: not run
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
    return policy_offline_needs([config.policies_for(phase) for phase in PHASES])


def replay_cell(prep: PreparedTrace, capacity_bytes: int | None, config: ResidencyConfig, *,
                label: str, capacity_label: str = "", with_belady: bool = True,
                profile=None) -> CellResult:
    """Replay ``prep`` through a simulated manager; with the Belady ceiling when asked.
    ``capacity_bytes`` None: the device pools the trace recorded (a live run's, exactly).

    The ceiling is the manager's ``belady`` preset (eviction belady, admission belady-bypass)
    through the same core; tests hold it equal to ``belady.belady_ceiling``, an offline loop
    written apart from the manager, on real and random traces. ``profile``: a RoutingProfile
    that warm-starts the learned policies (never the ceiling).
    """
    cell = _run(prep, capacity_bytes, config, label, capacity_label, profile)
    if not with_belady or capacity_bytes is None:
        return cell
    ceiling = prep.ceiling(capacity_bytes)
    return replace(cell, belady_prefill_demand_miss_bytes=ceiling.demand_miss_bytes[0],
                   belady_decode_demand_miss_bytes=ceiling.demand_miss_bytes[1])


def _run(prep: PreparedTrace, capacity_bytes: int | None, config: ResidencyConfig, label: str,
         capacity_label: str, profile=None) -> CellResult:
    h = prep.trace.header
    prep.runs += 1
    mgr = simulated_manager(h, capacity_bytes, config)
    if profile is not None:
        mgr.warm_start(DEVICE, profile)
    outcome = mgr.replay(DEVICE, prep.bounds, prep.layer_arr, prep.phase_arr, prep.expert_i32,
                         prep.next_use() if offline_needs(config)[0] else None,
                         offline_needs(config)[1])
    cost = CostModel(config.cost, h.expert_bytes, h.dense_bytes)
    timing = prefetch_timing(cost, prep.bounds, prep.layer_arr, prep.phase_arr,
                             prep.multi_token, prep.experts, outcome, h.n_expert,
                             h.n_expert_used)
    priced = outcome.miss_kind
    if len(outcome.prefetch_batch):          # late first uses are misses, in-time ones hits
        priced = priced.copy()
        priced[priced == 4] = 0
        priced[timing.late_rows] = 2
    _price(cost, prep, priced)
    snap = mgr.snapshot().device(DEVICE)
    for phase in PHASES:
        cost.add_prefetch_bytes(phase, snap.phase(phase).prefetch_issued_bytes)
    ttft, tpot = cost.estimate(prefill_turns=prep.prefill_turns,
                               decode_tokens=prep.decode_tokens)
    wasted = _unused_prefetch_bytes(prep, outcome, h)
    phase_results = [PhaseResult.from_counters(snap.phase(ph), int(timing.late[ph]),
                                               int(timing.late_bytes[ph]), int(wasted[ph]))
                     for ph in PHASES]
    prefill = phase_results[Phase.PREFILL]
    decode = _sum_phases(phase_results[Phase.DECODE], phase_results[Phase.MIXED])
    total = capacity_bytes if capacity_bytes is not None else sum(p.capacity_bytes
                                                                   for p in h.pools)
    return CellResult(trace=prep.name, policy=label, capacity_bytes=total,
                      capacity_label=capacity_label or str(total), prefill=prefill,
                      decode=decode, decode_tokens=prep.decode_tokens,
                      cold_miss_bytes=prep.cold_miss_bytes, est_ttft_s=ttft, est_tpot_s=tpot)


def simulated_manager(header, capacity_bytes: int | None, config: ResidencyConfig
                      ) -> ExpertResidencyManager:
    """The manager a cell replays through: one simulated device of ``capacity_bytes``, or,
    with None, of the pools (layers, capacity) the trace recorded from a live device."""
    if capacity_bytes is not None:
        return ExpertResidencyManager.create_simulated(
            expert_bytes=header.expert_bytes, n_expert=header.n_expert,
            capacity_bytes=capacity_bytes, config=config, device=DEVICE,
            n_expert_used=header.n_expert_used)
    if not header.pools:
        raise UserError(f"{header.model}: the trace recorded no device pools; give a capacity")
    mgr = ExpertResidencyManager(config)
    mgr.bind_model(header.expert_bytes, header.n_expert, header.n_expert_used)
    mgr.set_pools(DEVICE, [PoolSpec(tuple(p.layers), p.capacity_bytes) for p in header.pools])
    return mgr


def _unused_prefetch_bytes(prep: PreparedTrace, outcome, header) -> np.ndarray:
    """(3,) bytes of the prefetches never used, by the phase that issued them."""
    used = np.zeros(len(outcome.prefetch_batch), dtype=bool)
    used[outcome.prefetch_event[outcome.miss_kind == 4]] = True
    unused = ~used
    layer = outcome.prefetch_flat[unused].astype(np.int64) // header.n_expert
    phase = prep.phase_arr[outcome.prefetch_batch[unused]].astype(np.int64)
    return np.bincount(phase, weights=np.asarray(header.expert_bytes, dtype=np.float64)[layer],
                       minlength=3).astype(np.int64)


def _price(cost: CostModel, prep: PreparedTrace, miss_kind: np.ndarray) -> None:
    """Feed the cost model from each row's miss kind (1 admitted, 2 transient; 0 on
    hits and repeats): multi-token batches one by one, one-token batches summed per layer."""
    n_layer = len(cost.expert_bytes)
    bounds = prep.bounds
    sizes = np.diff(bounds)
    batch_of = np.repeat(np.arange(len(sizes)), sizes)
    missed = np.bincount(batch_of, weights=(miss_kind != 0), minlength=len(sizes))
    admitted = np.bincount(batch_of, weights=(miss_kind == 1), minlength=len(sizes))
    multi = prep.multi_token
    k = prep.trace.header.n_expert_used
    for b in np.flatnonzero(multi).tolist():
        s, e = int(bounds[b]), int(bounds[b + 1])
        experts = prep.experts[s:e]
        kinds = miss_kind[s:e]
        keys, tokens = np.unique(experts, return_counts=True)
        miss_ids = set(experts[kinds != 0].tolist())
        adm_ids = set(experts[kinds == 1].tolist())
        ids = keys.tolist()
        cost.add_batch_call(int(prep.phase_arr[b]), int(prep.layer_arr[b]), (e - s) // k, tokens,
                            np.fromiter((x in miss_ids for x in ids), dtype=bool, count=len(ids)),
                            np.fromiter((x in adm_ids for x in ids), dtype=bool, count=len(ids)))
    single = ~multi
    if not single.any():
        return
    layer = prep.layer_arr[single].astype(np.int64)
    phase = prep.phase_arr[single].astype(np.int64)
    hits = (sizes[single] - missed[single]).astype(np.float64)
    miss = missed[single]
    adm = admitted[single]
    for ph in PHASES:
        m = phase == int(ph)
        if m.any():
            per_layer = [np.bincount(layer[m], weights=w[m], minlength=n_layer)
                         for w in (hits, miss, adm, np.ones(len(layer)))]
            cost.add_single_token_counts(int(ph), *per_layer)


def _sum_phases(a: PhaseResult, b: PhaseResult) -> PhaseResult:
    return PhaseResult(**{name: getattr(a, name) + getattr(b, name)
                          for name in a.__dataclass_fields__})
