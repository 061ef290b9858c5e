"""``NativeCore``: one device's decisions in the C core (residency_core.c), through cffi.

Every method mirrors ``runtime.residency.reference.ReferenceCore`` exactly (tests compare the
two); results are plain tuples of flat keys (``layer * n_expert + expert``).
"""
from __future__ import annotations

import numpy as np

from runtime.residency.core import (ADMISSION_KINDS, EVICTION_KINDS, PREFETCH_KINDS, CorePolicy,
                                    history_ok)
from runtime.residency.core.build import load_core

_EMPTY: tuple = ()
_I32_MIN, _I32_MAX = -(2**31), 2**31 - 1


def _int32(values) -> np.ndarray:
    """values as a contiguous int32 array; ids outside int32 become -1 (rejected as ids)."""
    arr = np.asarray(values)
    if arr.dtype == np.int32 and arr.flags.c_contiguous:
        return arr
    if arr.size and arr.dtype.kind in "iu":
        lo, hi = int(arr.min()), int(arr.max())
        if lo < _I32_MIN or hi > _I32_MAX:
            arr = np.where((arr < _I32_MIN) | (arr > _I32_MAX), -1, arr)
    elif arr.size and arr.dtype.kind != "b":
        raise TypeError(f"expert ids must be integers, got {arr.dtype}")
    return np.ascontiguousarray(arr, dtype=np.int32).reshape(-1)


class NativeCore:
    """One device: see runtime/residency/core/residency_core.h."""

    def __init__(self, n_layer: int, n_expert: int, expert_bytes, policy: CorePolicy, *,
                 inline: bool):
        lib, ffi = load_core()
        self.lib, self.ffi = lib, ffi
        p = ffi.new("rc_policy *")
        p.n_orders = len(policy.orders)
        for i, (name, p1, p2) in enumerate(policy.orders):
            p.order_kind[i] = EVICTION_KINDS[name]
            p.order_p1[i], p.order_p2[i] = p1, p2
        p.decay_rate = policy.decay_rate
        p.nv_learning_rate = policy.nv_learning_rate
        for ph in range(3):
            p.phase_order[ph] = policy.phase_order[ph]
            p.admission[ph] = ADMISSION_KINDS[policy.admission[ph][0]]
            p.admission_p1[ph] = policy.admission[ph][1]
            p.prefetch[ph] = PREFETCH_KINDS[policy.prefetch[ph][0]]
            p.prefetch_p1[ph] = policy.prefetch[ph][1]
            if policy.prefetch[ph][0] == "affinity":
                p.prefetch_p1[ph], p.prefetch_p2[ph], p.prefetch_p3[ph] = policy.affinity
        for i, rate in enumerate(policy.affinity_rates):
            p.affinity_rates[i] = rate
        p.n_expert_used = policy.n_expert_used
        p.track_next_use = int(policy.track_next_use)
        p.inline_transport = int(inline)
        self._eb = ffi.new("int64_t[]", [int(b) for b in expert_bytes])
        handle = lib.rc_create(n_layer, n_expert, self._eb, p)
        if handle == ffi.NULL:
            raise MemoryError("rc_create failed")
        self._c = ffi.gc(handle, lib.rc_free)
        self._out = ffi.new("rc_result *")
        self.n_layer, self.n_expert = n_layer, n_expert
        self.n_moe = sum(1 for b in expert_bytes if int(b) > 0)
        self.last_bad = 0

    # -- configuration -------------------------------------------------------------------
    def set_inline(self, inline: bool) -> None:
        self.lib.rc_set_inline(self._c, int(inline))

    def set_pools(self, pool_of_layer, capacities) -> int:
        ffi = self.ffi
        return self.lib.rc_set_pools(self._c, len(capacities),
                                     ffi.new("int32_t[]", list(pool_of_layer)),
                                     ffi.new("int64_t[]", [int(c) for c in capacities]))

    def set_capacity(self, pool: int, capacity: int) -> int:
        return self.lib.rc_set_capacity(self._c, pool, capacity)

    @property
    def n_pool(self) -> int:
        return self.lib.rc_n_pool(self._c)

    def pool_of_layer(self, layer: int) -> int:
        return self.lib.rc_pool_of_layer(self._c, layer)

    # -- decisions -----------------------------------------------------------------------
    def _results(self) -> tuple:
        o, unpack = self._out, self.ffi.unpack
        admitted = tuple(unpack(o.admitted, o.n_admitted)) if o.n_admitted else _EMPTY
        evicted = tuple(unpack(o.evicted, o.n_evicted)) if o.n_evicted else _EMPTY
        transient = tuple(unpack(o.transient, o.n_transient)) if o.n_transient else _EMPTY
        tickets = tuple(unpack(o.tickets, o.n_tickets)) if o.n_tickets else _EMPTY
        new = tuple(unpack(o.new_tickets, o.n_new_tickets)) if o.n_new_tickets else _EMPTY
        prefetched = _EMPTY
        if o.n_prefetched:
            n = o.n_prefetched
            flats, ids = unpack(o.prefetched, n), unpack(o.prefetch_ids, n)
            nv = unpack(o.prefetch_n_victims, n)
            total = sum(nv)
            victims = unpack(o.prefetch_victims, total) if total else []
            out, at = [], 0
            for i in range(n):
                out.append((ids[i], flats[i], tuple(victims[at:at + nv[i]])))
                at += nv[i]
            prefetched = tuple(out)
        return (o.hits, o.misses, o.transition_hits, o.demand_miss_bytes, admitted, evicted,
                transient, tickets, new, prefetched)

    def access(self, layer: int, experts, phase: int, next_use=None, upcoming=None,
               lease_id: int = 0, release_id: int = 0):
        """(rc, hits, misses, transition_hits, demand_miss_bytes, admitted, evicted,
        transient, tickets, new_tickets, prefetched); ``upcoming``: (layer, experts, index)."""
        ffi = self.ffi
        el = _int32(experts)
        n = len(el)
        nu = ffi.NULL
        if next_use is not None:
            nua = np.ascontiguousarray(next_use, dtype=np.int64).reshape(-1)
            if len(nua) != n:
                return (-5,)
            nu = ffi.from_buffer("int64_t[]", nua)
        if upcoming is None:
            up_layer, up_e, up_i, n_up = -1, ffi.NULL, ffi.NULL, 0
        else:
            ul, ue, ui = upcoming
            ue = _int32(ue)
            ui = np.ascontiguousarray(ui, dtype=np.int64).reshape(-1)
            up_layer, n_up = int(ul), len(ue)
            up_e, up_i = ffi.from_buffer("int32_t[]", ue), ffi.from_buffer("int64_t[]", ui)
        rc = self.lib.rc_access(self._c, layer, ffi.from_buffer("int32_t[]", el), n, phase, nu,
                                up_layer, up_e, up_i, n_up, lease_id, release_id, self._out)
        if rc != 0:
            self.last_bad = self._out.bad_value
            return (rc,)
        return (0, *self._results())

    def release(self, lease_id: int) -> None:
        self.lib.rc_release(self._c, lease_id)

    def prefetch(self, flats, phase: int):
        """(rc, ..., prefetched) as access(); flats in priority order."""
        arr = _int32(flats)
        rc = self.lib.rc_prefetch(self._c, self.ffi.from_buffer("int32_t[]", arr), len(arr),
                                  phase, self._out)
        if rc != 0:
            return (rc,)
        return (0, *self._results())

    def replay(self, starts: np.ndarray, layers: np.ndarray, phases: np.ndarray,
               experts: np.ndarray, next_use: np.ndarray | None, with_upcoming: bool,
               miss_kind: np.ndarray, pf_event: np.ndarray | None = None) -> int:
        """Every batch of a trace through access() (no leases); see rc_replay. ``pf_event``
        (n rows, int64) gets the prefetch log index at the rows of kind 4."""
        ffi = self.ffi
        starts = np.ascontiguousarray(starts, dtype=np.int64)
        layers = np.ascontiguousarray(layers, dtype=np.int32)
        phases = np.ascontiguousarray(phases, dtype=np.int8)
        experts = np.ascontiguousarray(experts, dtype=np.int32)
        nu = ffi.NULL if next_use is None else ffi.from_buffer(
            "int64_t[]", np.ascontiguousarray(next_use, dtype=np.int64))
        return self.lib.rc_replay(self._c, len(starts) - 1, ffi.from_buffer("int64_t[]", starts),
                                  ffi.from_buffer("int32_t[]", layers),
                                  ffi.from_buffer("int8_t[]", phases),
                                  ffi.from_buffer("int32_t[]", experts), nu, int(with_upcoming),
                                  ffi.from_buffer("int8_t[]", miss_kind),
                                  ffi.NULL if pf_event is None else
                                  ffi.from_buffer("int64_t[]", pf_event))

    def replay_prefetches(self) -> tuple[np.ndarray, np.ndarray]:
        """(batch (n,) int64, flat (n,) int32) of every prefetch the latest replay issued."""
        b, f = self.ffi.new("int64_t **"), self.ffi.new("int32_t **")
        n = self.lib.rc_replay_prefetches(self._c, b, f)
        if n == 0:
            return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int32)
        return (np.frombuffer(self.ffi.buffer(b[0], 8 * n), dtype=np.int64).copy(),
                np.frombuffer(self.ffi.buffer(f[0], 4 * n), dtype=np.int32).copy())

    def warm_start(self, frequency: np.ndarray, pair: np.ndarray, count: np.ndarray,
                   history: np.ndarray | None = None) -> None:
        """Seed the learned policies from a routing profile (see rc_warm_start): frequency
        (n_layer, n_expert) float64, pair (n_moe - 1, E, E) and count (n_moe - 1, E) int32,
        history (tokens, n_moe, k) int16 (-1 pad) or None."""
        ffi = self.ffi
        freq = np.ascontiguousarray(frequency, dtype=np.float64).reshape(-1)
        pair = np.ascontiguousarray(pair, dtype=np.int32).reshape(-1)
        count = np.ascontiguousarray(count, dtype=np.int32).reshape(-1)
        given = np.asarray(history if history is not None else np.zeros((0, 0, 0)))
        if given.size and not history_ok(given, self.n_moe, self.n_expert):
            raise ValueError("warm_start: history must be (tokens, MoE layers, k) distinct "
                             "expert ids, then -1")   # (the core reads it as given)
        hist = np.ascontiguousarray(given, dtype=np.int16)
        self.lib.rc_warm_start(self._c, ffi.from_buffer("double[]", freq),
                               ffi.from_buffer("int32_t[]", pair) if pair.size else ffi.NULL,
                               ffi.from_buffer("int32_t[]", count) if count.size else ffi.NULL,
                               ffi.from_buffer("int16_t[]", hist) if hist.size else ffi.NULL,
                               hist.shape[0], hist.shape[2] if hist.ndim == 3 else 0)

    # -- tickets -------------------------------------------------------------------------
    def ticket(self, ticket_id: int):
        """(flat, phase, prefetch, bytes, victims) of a pending ticket, or None."""
        info = self.ffi.new("rc_ticket_info *")
        if self.lib.rc_ticket(self._c, ticket_id, info) != 0:
            return None
        victims = tuple(self.ffi.unpack(info.victims, info.n_victims)) if info.n_victims else ()
        return info.flat, info.phase, bool(info.prefetch), info.bytes, victims

    def commit(self, ticket_id: int) -> bool:
        return self.lib.rc_commit(self._c, ticket_id) == 1

    def abort(self, ticket_id: int) -> bool:
        return self.lib.rc_abort(self._c, ticket_id) == 1

    @property
    def n_pending(self) -> int:
        return self.lib.rc_pending_tickets(self._c)

    def forget(self, flat: int) -> int:
        return self.lib.rc_forget(self._c, flat)

    def pin_static(self, flats) -> int:
        arr = _int32(flats)
        return self.lib.rc_pin_static(self._c, self.ffi.from_buffer("int32_t[]", arr), len(arr))

    # -- queries -------------------------------------------------------------------------
    def states(self) -> np.ndarray:
        """(n_layer, n_expert) uint8 key states, a copy."""
        n = self.n_layer * self.n_expert
        buf = self.ffi.buffer(self.lib.rc_states(self._c), n)
        return np.frombuffer(buf, dtype=np.uint8).reshape(self.n_layer, self.n_expert).copy()

    def state(self, flat: int) -> int:
        return self.lib.rc_state(self._c, flat)

    def use_counts(self) -> np.ndarray:
        """(3, n_layer, n_expert) int64 accesses per phase and key, a copy."""
        n = 3 * self.n_layer * self.n_expert
        buf = self.ffi.buffer(self.lib.rc_uses(self._c), n * 8)
        return np.frombuffer(buf, dtype=np.int64).reshape(3, self.n_layer, self.n_expert).copy()

    def pool_stats(self, pool: int) -> tuple[int, int, int, int, int]:
        """(capacity or -1, resident bytes, resident experts, pending bytes, pending tickets)."""
        lib, c = self.lib, self._c
        return (lib.rc_pool_capacity(c, pool), lib.rc_pool_resident_bytes(c, pool),
                lib.rc_pool_resident_count(c, pool), lib.rc_pool_pending_bytes(c, pool),
                lib.rc_pool_pending_tickets(c, pool))

    def counters(self, pool: int, phase: int) -> tuple[int, ...]:
        lib, c = self.lib, self._c
        return tuple(lib.rc_counter(c, pool, phase, k) for k in range(14))

    @property
    def n_leases(self) -> int:
        return self.lib.rc_n_leases(self._c)

    def verify(self) -> int:
        return self.lib.rc_verify(self._c)
