"""One device of the residency manager (``Device``: its core, pools and static state), its
reports (``snapshot``, ``expert_map``), its pools' layer map (``pool_of_layer``) and what its
refusals say (``refusal``, ``replay_problem``): the manager has one per device and guards them
with its lock."""
from __future__ import annotations

import numpy as np

from runtime.errors import UserError
from runtime.residency import core as core_api
from runtime.residency.core import (ERR_EXPERT, ERR_LAYER, ERR_NEXT_USE, ERR_NEXT_USE_LEN,
                                    ERR_UPCOMING, RESIDENT_MAX, CoreError, PoolStats)
from runtime.residency.telemetry import (STATE_CHARS, DeviceSnapshot, ExpertMap, PhaseCounters,
                                         PoolSnapshot)
from runtime.residency.types import Phase, ReplayOutcome

_PHASES = (Phase.PREFILL, Phase.DECODE, Phase.MIXED)

# what a refused access says (CoreError.status -> message)
_ACCESS_ERRORS = {
    ERR_LAYER: "layer {layer} has no routed experts in the model",
    ERR_EXPERT: "expert id {bad} out of range [0, {n})",
    ERR_UPCOMING: "prefetch policy 'belady' is offline-only; pass upcoming",
    ERR_NEXT_USE: "an offline (belady) policy is configured; pass next_use",
    ERR_NEXT_USE_LEN: "next_use must have one entry per expert",
}


def refusal(err: CoreError, layer: int, n_expert: int) -> Exception:
    """What a refused access raises: UserError naming the problem (RuntimeError for a status
    no input causes)."""
    message = _ACCESS_ERRORS.get(err.status)
    if message is None:
        return RuntimeError(f"residency core: status {err.status}")
    return UserError("access_layer: " + message.format(layer=layer, bad=err.bad_value,
                                                       n=n_expert))


def pool_of_layer(device: str, pools, n_layer: int, moe_layers: tuple[int, ...]) -> list[int]:
    """(n_layer,) the pool of each layer (-1: dense) for ``pools`` (PoolSpecs): UserError
    unless every MoE layer is in exactly one pool and every capacity is >= 0."""
    of_layer = [-1] * n_layer
    for i, pool in enumerate(pools):
        if pool.capacity_bytes < 0:
            raise UserError(f"{device}: pool {i}: capacity must be >= 0")
        for layer in pool.layers:
            if layer not in moe_layers or of_layer[layer] != -1:
                raise UserError(f"{device}: pool {i}: layer {layer} is not a MoE layer, or "
                                "is in two pools")
            of_layer[layer] = i
    missing = [layer for layer in moe_layers if of_layer[layer] < 0]
    if missing:
        raise UserError(f"{device}: layers {missing} are in no pool")
    return of_layer


class Device:
    """One device of the manager: its core, pools, static flag and why nothing is admitted
    yet. The manager's lock guards it."""

    __slots__ = ("name", "core", "pools", "static", "static_bytes", "reason", "sim")

    def __init__(self, name: str, core, layers: tuple[int, ...], sim: bool):
        self.name = name
        self.core = core
        self.pools: tuple[tuple[int, ...], ...] = (layers,)
        self.static = False
        self.static_bytes = 0
        self.reason = "capacity not resolved yet (resolve_device() has not run)"
        self.sim = sim            # nothing moves: no transport calls at all

    def replay(self, bounds, layers, phases, experts, next_use, upcoming) -> ReplayOutcome:
        """The core's batch loop over a trace (the manager checked the ids and holds its
        lock); CoreError if the core refused a batch."""
        miss_kind = np.zeros(len(experts), dtype=np.int8)
        pf_event = np.full(len(experts), -1, dtype=np.int64)
        rc = self.core.replay(bounds, layers, phases, experts, next_use, upcoming, miss_kind,
                              pf_event)
        if rc != 0:
            raise CoreError(rc)
        pf_batch, pf_flat = self.core.replay_prefetches()
        return ReplayOutcome(miss_kind, pf_event, pf_batch, pf_flat)

    def snapshot(self) -> DeviceSnapshot:
        """Counters and occupancy of every pool, frozen (under the manager's lock)."""
        pools = []
        for i, layers in enumerate(self.pools):
            st: PoolStats = self.core.pool_stats(i)
            phases = tuple(_counters(st.counters[int(p)]) for p in _PHASES)
            pools.append(PoolSnapshot(layers, None if st.capacity < 0 else st.capacity,
                                      st.resident_bytes, st.resident_count, phases))
        total = tuple(sum((p.phases[i] for p in pools), PhaseCounters()) for i in range(3))
        caps = [p.capacity_bytes for p in pools]
        return DeviceSnapshot(self.name, None if None in caps else sum(caps),
                              sum(p.resident_bytes for p in pools),
                              sum(p.resident_experts for p in pools), total, self.reason,
                              self.static_bytes if self.static else None, tuple(pools))


def replay_problem(experts: np.ndarray, layers: np.ndarray, n_expert: int, n_layer: int,
                   moe_layers: tuple[int, ...]) -> str | None:
    """What is wrong with a trace's rows (an expert id out of range, a layer without routed
    experts), or None; checked before the core changes anything."""
    moe = np.zeros(n_layer, dtype=bool)
    moe[list(moe_layers)] = True
    bad = experts[(experts < 0) | (experts >= n_expert)]
    if bad.size:
        return f"expert id {int(bad[0])} out of range [0, {n_expert})"
    bad_layer = layers[(layers < 0) | (layers >= len(moe))]
    if bad_layer.size or not moe[layers].all():
        layer = int(bad_layer[0]) if bad_layer.size else int(layers[~moe[layers]][0])
        return f"layer {layer} has no routed experts in the model"
    return None


def expert_map(states: np.ndarray, uses: np.ndarray, moe_layers) -> ExpertMap:
    """states (n_layer, n_expert) uint8 and uses (3, n_layer, n_expert) int64 of a core as an
    ExpertMap of the MoE layers."""
    layers = list(moe_layers)
    states = states[layers]                                  # (n_moe, n_expert)
    routed = uses.sum(axis=0)[layers]                        # (n_moe, n_expert)
    chars = np.full(states.shape, ord(STATE_CHARS["absent"]), dtype=np.uint8)
    chars[states <= RESIDENT_MAX] = ord(STATE_CHARS["resident"])
    return ExpertMap(tuple(layers), tuple(row.tobytes().decode() for row in chars),
                     tuple(tuple(row) for row in routed.tolist()))


def _counters(values: tuple[int, ...]) -> PhaseCounters:
    d = dict(zip(core_api.COUNTERS, values))
    return PhaseCounters(hits=d["accesses"] - d["misses"], **d)
