"""``CCore``: one device's decisions in the C core (residency_core.c), through cffi.

Every method mirrors ``runtime.residency.reference.core.ReferenceCore`` exactly (tests compare
the two); decisions come back as ``CoreAccess`` records of flat keys (``layer * n_expert +
expert``), a refused call as ``CoreError``.
"""
from __future__ import annotations

import numpy as np

from runtime.clib import load_library
from runtime.errors import UserError
from runtime.residency.core import (COUNTERS, ERR_NEXT_USE_LEN, ERR_POOL, CoreAccess, CoreError,
                                    CorePolicy, PoolStats, history_ok)

_EMPTY: tuple = ()
_new_access = tuple.__new__   # builds a CoreAccess without its Python-level __new__
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


def c_policy_names(lib, ffi, role: str) -> tuple[str, ...]:
    """The names of ``role``'s policies in a built core (its policy files), kind order."""
    rc_role, names = getattr(lib, f"RC_ROLE_{role.upper()}"), []
    while (name := lib.rc_policy_name(rc_role, len(names))) != ffi.NULL:
        names.append(ffi.string(name).decode())
    return tuple(names)


def c_policy_kind(lib, ffi, role: str, name: str) -> int:
    """The core's kind of a policy name (its index in the generated table: core_impl.h)."""
    kind = lib.rc_policy_kind(getattr(lib, f"RC_ROLE_{role.upper()}"), name.encode())
    if kind < 0:
        raise UserError(f"the residency core has no {role} policy {name!r} (its {role} "
                        f"policies: {', '.join(c_policy_names(lib, ffi, role))}); a policy "
                        "needs its file in runtime/residency/core/policies/")
    return kind


def _set_block(lib, row, role: str, name: str, block: tuple[float, ...]) -> None:
    """A policy's C parameter block into its row of rc_policy (the rest stays 0)."""
    if len(block) > lib.RC_MAX_PARAMS:
        raise ValueError(f"{role} policy {name!r}: {len(block)} C parameters, at most "
                         f"{lib.RC_MAX_PARAMS}")
    for i, value in enumerate(block):
        row[i] = value


class CCore:
    """One device: see runtime/residency/core/residency_core.h."""

    def __init__(self, n_layer: int, n_expert: int, expert_bytes, policy: CorePolicy):
        lib, ffi = load_library()
        self.lib, self.ffi = lib, ffi
        p = ffi.new("rc_policy *")
        p.n_orders = len(policy.orders)
        for i, (name, block) in enumerate(policy.orders):
            p.order_kind[i] = c_policy_kind(lib, ffi, "eviction", name)
            _set_block(lib, p.order_params[i], "eviction", name, block)
        for ph in range(3):
            p.phase_order[ph] = policy.phase_order[ph]
            name, block = policy.admission[ph]
            p.admission[ph] = c_policy_kind(lib, ffi, "admission", name)
            _set_block(lib, p.admission_params[ph], "admission", name, block)
            name, block = policy.prefetch[ph]
            p.prefetch[ph] = c_policy_kind(lib, ffi, "prefetch", name)
            _set_block(lib, p.prefetch_params[ph], "prefetch", name, block)
        p.n_expert_used = policy.n_expert_used
        p.track_next_use = int(policy.track_next_use)
        self._eb = ffi.new("int64_t[]", [int(b) for b in expert_bytes])
        handle = lib.rc_create(n_layer, n_expert, self._eb, p)
        if handle == ffi.NULL:
            raise MemoryError("rc_create failed")
        self._c = ffi.gc(handle, lib.rc_free)
        self._out = ffi.new("rc_result *")
        self.n_layer, self.n_expert = n_layer, n_expert
        self.n_moe = sum(1 for b in expert_bytes if int(b) > 0)
        self._stats = ffi.new("rc_pool_stats *")
        self._held = ffi.new("int64_t *")         # step()'s lease, in and out

    # -- configuration -------------------------------------------------------------------
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
    def _results(self) -> CoreAccess:
        o, unpack = self._out, self.ffi.unpack
        admitted = tuple(unpack(o.admitted, o.n_admitted)) if o.n_admitted else _EMPTY
        evicted = tuple(unpack(o.evicted, o.n_evicted)) if o.n_evicted else _EMPTY
        transient = tuple(unpack(o.transient, o.n_transient)) if o.n_transient else _EMPTY
        prefetched = _EMPTY
        if o.n_prefetched:
            n = o.n_prefetched
            flats, nv = unpack(o.prefetched, n), unpack(o.prefetch_n_victims, n)
            total = sum(nv)
            victims = unpack(o.prefetch_victims, total) if total else []
            out, at = [], 0
            for i in range(n):
                out.append((flats[i], tuple(victims[at:at + nv[i]])))
                at += nv[i]
            prefetched = tuple(out)
        return _new_access(CoreAccess, (o.hits, o.misses, o.transition_hits,
                                        o.demand_miss_bytes, admitted, evicted, transient,
                                        prefetched))

    def access(self, layer: int, experts, phase: int, next_use=None, upcoming=None,
               lease_id: int = 0, release_id: int = 0):
        """One layer-step's decisions (CoreError if refused); ``upcoming``: (layer, experts,
        index)."""
        ffi = self.ffi
        el = _int32(experts)
        n = len(el)
        nu = ffi.NULL
        if next_use is not None:
            nua = np.ascontiguousarray(next_use, dtype=np.int64).reshape(-1)
            if len(nua) != n:
                raise CoreError(ERR_NEXT_USE_LEN)
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
            raise CoreError(rc, self._out.bad_value)
        return self._results()

    def release(self, lease_id: int) -> None:
        self.lib.rc_release(self._c, lease_id)

    def lease_id(self) -> int:
        """A fresh lease id (the core owns every lease id: rc_lease_id)."""
        return self.lib.rc_lease_id(self._c)

    def step(self, held: int, layer: int, experts, phase: int) -> tuple[int, CoreAccess]:
        """One consumer's layer-step (rc_step): lease the layer's experts under a new id and
        end ``held`` (0: none) in the same call; (the new lease, the decisions). On CoreError
        ``held`` has ended all the same and nothing is leased."""
        el = _int32(experts)
        h = self._held
        h[0] = held
        rc = self.lib.rc_step(self._c, h, layer, self.ffi.from_buffer("int32_t[]", el), len(el),
                              phase, self._out)
        if rc != 0:
            raise CoreError(rc, self._out.bad_value)
        return h[0], self._results()

    def step_end(self, held: int) -> None:
        """End a consumer's last lease (rc_step_end: the batch ended)."""
        h = self._held
        h[0] = held
        self.lib.rc_step_end(self._c, h)

    def prefetch(self, flats, phase: int):
        """What a prefetch of ``flats`` (priority order) decided, as access()."""
        arr = _int32(flats)
        rc = self.lib.rc_prefetch(self._c, self.ffi.from_buffer("int32_t[]", arr), len(arr),
                                  phase, self._out)
        if rc != 0:
            raise CoreError(rc)
        return self._results()

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

    # -- the mechanism ---------------------------------------------------------------------
    def forget(self, flat: int) -> int:
        return self.lib.rc_forget(self._c, flat)

    def pin_static(self, flats) -> int:
        arr = _int32(flats)
        return self.lib.rc_pin_static(self._c, self.ffi.from_buffer("int32_t[]", arr), len(arr))

    # -- queries -------------------------------------------------------------------------
    def states(self) -> np.ndarray:
        """(n_layer, n_expert) uint8 key states, a copy."""
        out = np.empty((self.n_layer, self.n_expert), dtype=np.uint8)
        self.lib.rc_copy_states(self._c, self.ffi.from_buffer("uint8_t[]", out))
        return out

    def state(self, flat: int) -> int:
        return self.lib.rc_state(self._c, flat)

    def use_counts(self) -> np.ndarray:
        """(3, n_layer, n_expert) int64 accesses per phase and key, a copy."""
        out = np.empty((3, self.n_layer, self.n_expert), dtype=np.int64)
        self.lib.rc_copy_uses(self._c, self.ffi.from_buffer("int64_t[]", out))
        return out

    def pool_stats(self, pool: int) -> PoolStats:
        """One pool's occupancy and counters, one consistent state (rc_pool_snapshot)."""
        st = self._stats
        if self.lib.rc_pool_snapshot(self._c, pool, st) != 0:
            raise CoreError(ERR_POOL)
        k = len(COUNTERS)
        return PoolStats(st.capacity, st.resident_bytes, st.resident_count,
                         tuple(tuple(self.ffi.unpack(st.counters[ph], k)) for ph in range(3)))

    def counters(self, pool: int, phase: int) -> tuple[int, ...]:
        return self.pool_stats(pool).counters[phase]

    @property
    def n_leases(self) -> int:
        return self.lib.rc_n_leases(self._c)

    def verify(self) -> int:
        return self.lib.rc_verify(self._c)
