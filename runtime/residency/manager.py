"""ExpertResidencyManager: the one authority for where every expert lives.

Usage (simulated: no device, no llama.cpp; the live runtime runs the same code)::

    import numpy as np
    from runtime.residency.manager import ExpertResidencyManager
    from runtime.residency.types import ExpertKey, Phase

    m = ExpertResidencyManager.create_simulated(
        expert_bytes=[3 << 20] * 48, n_expert=128, capacity_bytes=2 << 30, policy="lru")
    access = m.access_layer("sim", 0, np.array([5, 17, 3, 90]), Phase.DECODE)
    ...                                  # run the layer's experts; they are leased meanwhile
    m.release(access)
    print(access.hits, access.misses, access.demand_miss_bytes)
    print(m.snapshot().to_prometheus())

Live: ``m = ExpertResidencyManager(load_config(path), transport=...)``, then
``m.bind_model(facts.expert_bytes, facts.n_expert)`` and ``m.resolve_devices()``; each
``access_layer`` returns tickets to wait on (``m.wait(access.tickets)``) before the matmul.

The manager owns slots, bytes, leases and counters (``DeviceState``); policies only score and
decide (``policies/``). One lock guards the state; it is never held while bytes move: tickets
are handed to the transport after the lock is released.
"""
from __future__ import annotations

import math
import threading
from typing import Callable, Sequence

import numpy as np

from runtime.errors import UserError
from runtime.residency.capacity import probe_device_memory, resolve_budget
from runtime.residency.config import ResidencyConfig, preset_config
from runtime.residency.device_state import (ABSENT, EVICTING, MISSING, PENDING, RESIDENT_MAX,
                                            DeviceState)
from runtime.residency.policies import factory
from runtime.residency.policies.admission import AdmissionQuery
from runtime.residency.policies.prefetch import NoPrefetch, PrefetchContext
from runtime.residency.stats import UsageStats
from runtime.residency.telemetry import DeviceSnapshot, ResidencySnapshot
from runtime.residency.transport import SimulatedTransport, Transport
from runtime.residency.types import ExpertKey, LayerAccess, Phase, Ticket, UpcomingStep

_EMPTY: tuple = ()
_DECODE = int(Phase.DECODE)
_NO_KEYS: frozenset = frozenset()


class ExpertResidencyManager:
    """Decides, records and counts expert residency on every device. Thread-safe."""

    def __init__(self, config: ResidencyConfig | None = None, *,
                 transport: Transport | None = None):
        self.config = config if config is not None else ResidencyConfig()
        self._transport = transport if transport is not None else SimulatedTransport()
        self._inline = bool(getattr(self._transport, "inline", False))
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        phases = [self.config.policies_for(p) for p in Phase]
        specs: list = []
        for pp in phases:
            if pp.eviction not in specs:
                specs.append(pp.eviction)
        self._eviction_specs = specs
        self._phase_evictor = tuple(specs.index(pp.eviction) for pp in phases)
        self._admission = [factory.build_admission(pp.admission) for pp in phases]
        self._prefetch = [factory.build_prefetch(pp.prefetch) for pp in phases]
        self._prefetch[Phase.MIXED] = NoPrefetch()  # MIXED: no speculative prefetch
        self._devices: dict[str, DeviceState] = {}
        self._n_expert = 0
        self._expert_bytes: np.ndarray | None = None
        self._moe_layer: list[bool] = []
        self._n_layer = 0
        self._layer_base: list[int] = []
        self._next_layers: list[tuple[int, ...]] = []
        self._seq = 0            # access sequence number: one per routed element
        self._next_lease = 1
        self._next_ticket = 1
        self._leases: dict[int, tuple[DeviceState, int, list[int]]] = {}  # id -> (dev, base, ids)
        self._drop_noop = isinstance(self._transport, SimulatedTransport)
        # the one-pass lru path needs the inline transport; tests turn it off to compare paths
        self._fast = self._inline
        self._transport.bind(self)

    # ---- setup ---------------------------------------------------------------------------
    @classmethod
    def create_simulated(cls, *, expert_bytes: Sequence[int], n_expert: int, capacity_bytes: int,
                         config: ResidencyConfig | None = None, policy: str | None = None,
                         device: str = "sim") -> ExpertResidencyManager:
        """A manager over one simulated device with a fixed capacity (no GPU, no llama.cpp).

        ``policy`` is a preset name (``preset_config``), exclusive with ``config``.
        """
        if config is not None and policy is not None:
            raise ValueError("give config or policy, not both")
        if policy is not None:
            config = preset_config(policy)
        manager = cls(config)
        manager.bind_model(expert_bytes, n_expert)
        manager.reconfigure(device, capacity_bytes)
        return manager

    def bind_model(self, expert_bytes: Sequence[int], n_expert: int) -> None:
        """Learn the model's shape: bytes of one expert per layer (0: dense), experts per layer."""
        eb = np.asarray(expert_bytes, dtype=np.int64)
        if eb.ndim != 1 or len(eb) == 0 or (eb < 0).any() or n_expert <= 0:
            raise UserError("bind_model: need per-layer expert bytes (>= 0) and n_expert > 0")
        with self._lock:
            if self._expert_bytes is not None:
                raise UserError("bind_model: a model is already bound to this manager")
            self._expert_bytes = eb
            self._n_expert = int(n_expert)
            self._moe_layer = (eb > 0).tolist()
            self._n_layer = len(eb)
            # flat key of (layer, expert 0); -1 for dense layers
            self._layer_base = [i * int(n_expert) if b else -1
                                for i, b in enumerate(self._moe_layer)]
            moe = [i for i, b in enumerate(self._moe_layer) if b]
            self._next_layers = [tuple(x for x in moe if x > i) for i in range(len(eb))]
            for budget in self.config.devices:
                self._add_device(budget.device)

    def _add_device(self, name: str) -> DeviceState:
        evictors = [factory.build_eviction(s) for s in self._eviction_specs]
        rates = {e.decay_rate for e in evictors if e.decay_rate > 0}
        if len(rates) > 1:
            raise UserError(f"{self.config.source}: lfu-decay half_life must be the same in "
                            "every phase")
        roles = [*self._admission, *self._prefetch]
        stats = UsageStats(
            len(self._expert_bytes), self._n_expert,
            track_uses=any(getattr(p, "needs_uses", False) for p in [*evictors, *roles]),
            decay_rate=rates.pop() if rates else 0.0,
            track_next_use=any(getattr(p, "needs_next_use", False) for p in [*evictors, *roles]),
            track_history=any(getattr(p, "needs_history", False) for p in self._prefetch))
        st = DeviceState(name, self._expert_bytes, self._n_expert, evictors, self._phase_evictor,
                         stats)
        # lean: the per-access loop only records the access order (lru, or monotone scores
        # that need nothing else); anything else takes the general loop
        # fast[phase]: that phase may take _access_lru_inline (lru alone, admit always,
        # no prefetch, inline transport)
        st.fast = [False, False, False]
        st.lean = (len(st.recency) <= 1 and not st.touch_each and stats.uses is None
                   and stats.decay_log is None and stats.next_use is None
                   and (len(st.recency) == 0 or len(st.orders) == 1))
        st.fast = [bool(st.lean and st.recency and self._admission[p].trivial
                        and self._prefetch[p].name == "none") for p in range(3)]
        self._devices[name] = st
        return st

    def set_transport(self, transport: Transport) -> None:
        """Replace the transport: a tier (runtime.ramtier) attaching after the engine built
        the manager. Only while nothing is leased or in flight (RuntimeError otherwise)."""
        with self._lock:
            if self._leases or any(st.tickets for st in self._devices.values()):
                raise RuntimeError("set_transport: the manager has leases or tickets in flight")
            self._transport = transport
            self._inline = bool(getattr(transport, "inline", False))
            self._drop_noop = isinstance(transport, SimulatedTransport)
            self._fast = self._inline
        transport.bind(self)

    @property
    def transport(self) -> Transport:
        return self._transport

    def resolve_device(self, device: str, *, free_bytes: int | None,
                       total_bytes: int | None) -> int:
        """Turn the device's configured budget into bytes and apply it; returns the capacity."""
        if self._expert_bytes is None:
            raise UserError(f"{device}: capacity is resolved after bind_model()")
        capacity = resolve_budget(self.config.budget(device), free_bytes=free_bytes,
                                  total_bytes=total_bytes,
                                  largest_expert=int(self._expert_bytes.max()),
                                  source=self.config.source)
        self.reconfigure(device, capacity)
        return capacity

    def resolve_devices(self, probe: Callable[[str], tuple[int, int] | None] = probe_device_memory
                        ) -> dict[str, int]:
        """Resolve every configured device with ``probe(device) -> (free, total) | None``."""
        out = {}
        for budget in self.config.devices:
            mem = probe(budget.device)
            free, total = mem if mem is not None else (None, None)
            out[budget.device] = self.resolve_device(budget.device, free_bytes=free,
                                                     total_bytes=total)
        return out

    def reconfigure(self, device: str, capacity_bytes: int) -> None:
        """Set a device's capacity atomically. Refused (UserError) below the bytes charged
        (resident + in flight) or while tickets are pending on it."""
        with self._lock:
            if self._expert_bytes is None:
                raise UserError(f"{device}: reconfigure needs a bound model (bind_model)")
            st = self._devices.get(device) or self._add_device(device)
            if capacity_bytes <= 0:
                raise UserError(f"{device}: capacity must be positive, got {capacity_bytes}")
            if st.tickets:
                raise UserError(f"{device}: cannot reconfigure while {len(st.tickets)} "
                                "transfer(s) are pending")
            charged = st.resident_bytes + st.pending_bytes
            if capacity_bytes < charged:
                raise UserError(f"{device}: capacity {capacity_bytes} bytes is below the "
                                f"{charged} bytes currently charged")
            st.capacity = int(capacity_bytes)
            st.reason = ""

    # ---- the hot path --------------------------------------------------------------------
    def access_layer(self, device: str, layer: int, experts, phase: Phase, *,
                     step: int = 0, next_use=None, upcoming: UpcomingStep | None = None,
                     lease: bool = True) -> LayerAccess:
        """Record one layer-step's routed experts; see contracts.md ("Residency").

        experts: (n_tokens * k,) int expert ids in routing order, each in [0, n_expert)
        (ndarray or list). next_use: same shape, the access index of each element's next use
        (offline policies only). With ``lease`` the experts stay leased until
        ``release(access)``; ``lease=False`` holds them only during this call (replay).
        """
        st = self._devices.get(device)
        if st is None:
            self._unknown_device(device)
        el = experts if type(experts) is list else experts.tolist()
        n = len(el)
        with self._lock:
            if not 0 <= layer < self._n_layer or self._layer_base[layer] < 0:
                raise UserError(f"access_layer: layer {layer} has no routed experts in the model")
            base = self._layer_base[layer]
            seq0 = seq = self._seq
            self._seq = seq + n
            if (st.fast[phase] and self._fast and not self._leases and st.capacity is not None
                    and not st.tickets and not st.n_pf_unused and not st.pins_by_layer):
                return self._access_lru_inline(st, layer, base, el, phase, seq, lease)
            submit: list[Ticket] = []
            drops: list[ExpertKey] = []
            if st.lean:                       # lru alone: the loop only records access order
                state, last, ne = st.state, st.stats.last_seq, self._n_expert
                od = st.recency[0].od
                move = od.move_to_end
                missed = None
                tr = 0
                for e in el:
                    if not 0 <= e < ne:
                        self._bad_expert(e)
                    f = base + e
                    s = state[f]
                    if s > RESIDENT_MAX:      # placed in access order now, admitted or not later
                        if s != MISSING:      # first occurrence in this call
                            if s == ABSENT:
                                state[f] = MISSING
                            if missed is None:
                                missed = [e]
                            else:
                                missed.append(e)
                        od[f] = None
                    elif s == 0:
                        tr += 1
                    move(f)
                    last[f] = seq
                    seq += 1
            else:
                missed, tr = self._touch_general(st, base, el, seq, phase, next_use)
            if lease:
                lease_id = self._next_lease
                self._next_lease = lease_id + 1
                self._leases[lease_id] = (st, base, el)
            else:
                lease_id = 0
            if st.pins_by_layer:
                pins = st.pins_by_layer.pop(layer, None)
                if pins:
                    st.pinned.difference_update(pins)
            if st.stats.last_experts is not None:
                st.stats.last_experts[phase][layer] = np.array(el, dtype=np.int64)
            tally = st.tally[phase]
            tally.accesses += n
            if st.n_pf_unused:
                self._count_prefetch_used(st, base, el, tally)
            if phase != _DECODE:
                tr = 0
            tally.transition_hits += tr
            if missed is None:                # all hit: the common case
                tally.hits += n
                access = LayerAccess(device, layer, phase, n, 0, 0, _EMPTY, _EMPTY, _EMPTY,
                                     _EMPTY, tr, lease_id)
            else:
                others = (_NO_KEYS if len(self._leases) <= (1 if lease_id else 0)
                          else self._other_leases(st, lease_id))
                if (st.lean and self._inline and st.capacity is not None and not st.tickets
                        and self._admission[phase].trivial):
                    misses, admitted, evicted, transient = self._misses_lean(
                        st, base, missed, phase, tally, drops, seq0, others)
                    tickets = _EMPTY
                else:
                    misses, admitted, evicted, transient, tickets = self._handle_misses(
                        st, base, missed, phase, tally, submit, drops, seq0, others)
                tally.hits += n - misses
                access = LayerAccess(device, layer, phase, n - misses, misses,
                                     misses * st.bytes_flat[base], admitted, evicted, transient,
                                     tickets, tr, lease_id)
            prefetcher = self._prefetch[phase]
            if prefetcher.name != "none":
                self._run_prefetch(st, prefetcher, layer, base, el, phase, upcoming, submit,
                                   drops, seq0, lease_id)
        if submit or drops:
            self._after_unlock(st, submit, drops)
        return access

    def _access_lru_inline(self, st: DeviceState, layer: int, base: int, el: list[int],
                           phase: Phase, seq: int, lease: bool) -> LayerAccess:
        """access_layer for lru + demand admission + inline transport with nothing else held,
        pinned or in flight (replay, and the live decode loop between layers).

        Decides exactly as the general path (tests compare them): pass 1 touches every key in
        routing order (missed ones are placed in the order at their access), pass 2 admits the
        misses in routing order, each evicting the least recent keys not touched by this call.
        """
        state, last = st.state, st.stats.last_seq
        ne = self._n_expert
        od = st.recency[0].od
        move = od.move_to_end
        seq0 = seq
        tr = 0
        missed = None
        for e in el:
            if not 0 <= e < ne:
                self._bad_expert(e)
            f = base + e
            s = state[f]
            if s <= RESIDENT_MAX:
                if s == 0:
                    tr += 1
                move(f)
            elif s == ABSENT:                        # a demand miss (first occurrence)
                state[f] = MISSING
                od[f] = None
                if missed is None:
                    missed = [f]
                else:
                    missed.append(f)
            else:                                    # MISSING: a repeat, served by that copy
                move(f)
            last[f] = seq
            seq += 1
        n = len(el)
        if phase != _DECODE:
            tr = 0
        lease_id = 0
        if lease:
            lease_id = self._next_lease
            self._next_lease = lease_id + 1
            self._leases[lease_id] = (st, base, el)
        tally = st.tally[phase]
        tally.accesses += n
        tally.transition_hits += tr
        if missed is None:
            tally.hits += n
            return LayerAccess(st.name, layer, phase, n, 0, 0, _EMPTY, _EMPTY, _EMPTY, _EMPTY,
                               tr, lease_id)
        keys, nbytes = st.keys, st.bytes_flat
        b = nbytes[base]
        free = st.capacity - st.resident_bytes
        admitted = []
        evicted = []
        transient = None
        evicted_bytes = 0
        for f in missed:
            while free < b:
                v = next(iter(od))                   # the least recent key
                if last[v] >= seq0:                  # touched by this call: so is the rest
                    break
                del od[v]
                state[v] = ABSENT
                bv = nbytes[v]
                free += bv
                evicted_bytes += bv
                evicted.append(keys[v])
            if free < b:                             # everything evictable is this call's
                state[f] = ABSENT
                del od[f]
                if transient is None:
                    transient = [keys[f]]
                else:
                    transient.append(keys[f])
            else:
                state[f] = phase
                free -= b
                admitted.append(keys[f])
        n_adm, n_ev = len(admitted), len(evicted)
        misses = len(missed)
        tally.hits += n - misses
        tally.misses += misses
        tally.demand_miss_bytes += misses * b
        tally.admissions += n_adm
        tally.admitted_bytes += n_adm * b
        st.resident_bytes = st.capacity - free
        st.resident_count += n_adm - n_ev
        if transient is not None:
            tally.transient_uses += len(transient)
            tally.transient_bytes += len(transient) * b
            transient = tuple(transient)
        if n_ev:
            tally.evictions += n_ev
            tally.evicted_bytes += evicted_bytes
            if not self._drop_noop:
                self._lock.release()                 # never call out under the lock
                try:
                    for key in evicted:
                        self._transport.drop(st.name, key)
                finally:
                    self._lock.acquire()
        return LayerAccess(st.name, layer, phase, n - misses, misses, misses * b,
                           tuple(admitted), tuple(evicted) if n_ev else _EMPTY,
                           transient or _EMPTY, _EMPTY, tr, lease_id)

    def _touch_general(self, st: DeviceState, base: int, el: list[int], seq: int, phase: Phase,
                       next_use) -> tuple[list[int] | None, int]:
        """The per-element update when policies need more than the access order."""
        stats = st.stats
        state, last, ne = st.state, stats.last_seq, self._n_expert
        ods = [o.od for o in st.recency]
        uses = stats.uses
        uoff = int(phase) * stats.n_flat
        decay, rate = stats.decay_log, stats.decay_rate
        nu = stats.next_use
        if nu is not None:
            if next_use is None:
                raise UserError("access_layer: an offline (belady) policy is configured; "
                                "pass next_use")
            nul = next_use if type(next_use) is list else next_use.tolist()
            if len(nul) != len(el):
                raise UserError("access_layer: next_use must have one entry per expert")
        missed: list[int] = []
        tr = 0
        for i, e in enumerate(el):
            if not 0 <= e < ne:
                self._bad_expert(e)
            f = base + e
            s = state[f]
            if s > RESIDENT_MAX:
                if s != MISSING:                     # first occurrence in this call
                    if s == ABSENT:
                        state[f] = MISSING
                    missed.append(e)
                for od in ods:
                    od[f] = None
            elif s == 0:
                tr += 1
            for od in ods:
                od.move_to_end(f)
            last[f] = seq
            if uses is not None:
                uses[uoff + f] += 1
            if decay is not None:
                a, x = decay[f], rate * seq
                hi, lo = (a, x) if a > x else (x, a)
                decay[f] = hi + math.log1p(math.exp(lo - hi))
            if nu is not None:
                nu[f] = nul[i]
            seq += 1
        if st.touch_each:
            for f in dict.fromkeys([base + e for e in el]):
                if state[f] <= RESIDENT_MAX:
                    for order in st.touch_each:
                        order.touch(f)
        return (missed or None), tr

    def _other_leases(self, st: DeviceState, lease_id: int) -> set[int]:
        """Keys held by leases on ``st`` other than ``lease_id`` (usually none)."""
        if len(self._leases) <= (1 if lease_id else 0):
            return _NO_KEYS
        held: set[int] = set()
        for other_id, (owner, b, experts) in list(self._leases.items()):
            if owner is st and other_id != lease_id:
                held.update([b + e for e in experts])
        return held

    def _misses_lean(self, st: DeviceState, base: int, missed: list[int], phase: Phase, tally,
                     drops: list, seq0: int, others: set[int]):
        """Demand admission under lru with the inline transport and nothing in flight: the
        replay fast path. ``missed`` holds distinct keys, all MISSING (absent before the call).
        Same decisions as ``_handle_misses`` (a test compares them), fewer steps.
        """
        state, keys, nbytes = st.state, st.keys, st.bytes_flat
        od = st.recency[0].od
        last, pinned, pf = st.stats.last_seq, st.pinned, st.pf_unused
        b = nbytes[base]
        free = st.capacity - st.resident_bytes - st.pending_bytes
        admitted: list[ExpertKey] = []
        evicted: list[ExpertKey] = []
        transient: list[ExpertKey] = []
        evicted_bytes = wasted = 0
        for e in missed:
            flat = base + e
            if free < b:
                popped = []
                while free < b:
                    v = od.popitem(False)[0]         # the least recent key
                    if last[v] >= seq0 or v in others or v in pinned:
                        popped.append(v)             # protected: put back below
                        if last[v] >= seq0:
                            break                    # the rest is newer still
                        continue
                    state[v] = ABSENT
                    evicted.append(keys[v])
                    bv = nbytes[v]
                    free += bv
                    evicted_bytes += bv
                    if pf[v]:
                        pf[v] = 0
                        st.n_pf_unused -= 1
                        wasted += bv
                for v in reversed(popped):
                    od[v] = None
                    od.move_to_end(v, last=False)
                if free < b:                         # everything evictable is leased
                    del od[flat]
                    state[flat] = ABSENT
                    transient.append(keys[flat])
                    continue
            state[flat] = phase
            free -= b
            admitted.append(keys[flat])
        n_adm, n_ev = len(admitted), len(evicted)
        st.resident_bytes += n_adm * b - evicted_bytes
        st.resident_count += n_adm - n_ev
        n_missed = len(missed)
        tally.misses += n_missed
        tally.demand_miss_bytes += n_missed * b
        tally.admissions += n_adm
        tally.admitted_bytes += n_adm * b
        if n_ev:
            tally.evictions += n_ev
            tally.evicted_bytes += evicted_bytes
            tally.prefetch_wasted_bytes += wasted
            drops.extend(evicted)
        if transient:
            tally.transient_uses += len(transient)
            tally.transient_bytes += len(transient) * b
        return n_missed, tuple(admitted), tuple(evicted), tuple(transient)

    def _handle_misses(self, st: DeviceState, base: int, missed: list[int], phase: Phase, tally,
                       submit: list, drops: list, seq0: int, others: set[int]):
        """Demand misses of one call, any policy and transport (see contracts.md)."""
        order_keys = list(dict.fromkeys(missed)) if len(missed) > 1 else missed
        b = st.bytes_flat[base]
        misses = len(order_keys)
        tally.misses += misses
        tally.demand_miss_bytes += misses * b
        admitted: list[ExpertKey] = []
        evicted: list[ExpertKey] = []
        transient: list[ExpertKey] = []
        tickets: list[Ticket] = []
        order = st.phase_order[phase]
        admission = self._admission[phase]
        state, keys, nbytes = st.state, st.keys, st.bytes_flat
        for e in order_keys:
            flat = base + e
            s = state[flat]
            if s == MISSING:                         # absent before this call
                state[flat] = s = ABSENT
            if s == PENDING:                         # already in flight: join that transfer
                tickets.append(st.inflight[flat])
                self._unplace(st, flat)
                continue
            if st.capacity is None or s == EVICTING:
                transient.append(keys[flat])
                self._unplace(st, flat)
                continue
            free = st.capacity - st.resident_bytes - st.pending_bytes
            victims: list[int] = []
            if free < b:
                freed = 0
                while free + freed < b:
                    v = order.pop_victim(seq0, others, st.pinned)
                    if v is None:
                        break
                    victims.append(v)
                    freed += nbytes[v]
                order.settle()
                if free + freed < b:                 # everything evictable is leased
                    order.unpop(victims)
                    transient.append(keys[flat])
                    self._unplace(st, flat)
                    continue
            if not admission.trivial and not admission.admit(
                    self._admission_query(st, flat, phase, b, free, victims)):
                order.unpop(victims)
                transient.append(keys[flat])
                self._unplace(st, flat)
                continue
            key = keys[flat]
            admitted.append(key)
            vkeys = [keys[v] for v in victims]
            evicted.extend(vkeys)
            if self._inline:
                for v in victims:
                    st.evict(v, tally)
                drops.extend(vkeys)
                st.make_resident(flat, phase, False, in_recency=True)
                tally.admissions += 1
                tally.admitted_bytes += b
            else:
                self._unplace(st, flat)              # placed again when it commits
                ticket = Ticket(self._next_ticket, st.name, key, b, tuple(vkeys), phase, False)
                self._next_ticket += 1
                st.begin(ticket, flat, victims)
                tickets.append(ticket)
                submit.append(ticket)
        if transient:
            tally.transient_uses += len(transient)
            tally.transient_bytes += len(transient) * b
        return misses, tuple(admitted), tuple(evicted), tuple(transient), tuple(tickets)

    @staticmethod
    def _unplace(st: DeviceState, flat: int) -> None:
        """Take a missed key that did not become resident out of the recency orders."""
        for o in st.recency:
            o.od.pop(flat, None)

    def _admission_query(self, st: DeviceState, flat: int, phase: Phase, b: int, free: int,
                         victims: list[int]) -> AdmissionQuery:
        stats = st.stats
        first = victims[0] if victims else None
        nu = stats.next_use
        return AdmissionQuery(
            phase=phase, key_uses=stats.uses_of(flat), need_bytes=b, free_bytes=free,
            now_seq=stats.last_seq[flat],
            victim_seq=None if first is None else stats.last_seq[first],
            next_use=None if nu is None else nu[flat],
            victim_next_use=None if (nu is None or first is None) else nu[first])

    def _count_prefetch_used(self, st: DeviceState, base: int, el: list[int], tally) -> None:
        pf = st.pf_unused
        used = 0
        for e in el:
            if pf[base + e]:
                pf[base + e] = 0
                used += 1
        if used:
            st.n_pf_unused -= used
            tally.prefetch_used_bytes += used * st.bytes_flat[base]

    def _after_unlock(self, st: DeviceState, submit: list[Ticket], drops: list[ExpertKey]) -> None:
        if drops and not self._drop_noop:
            for key in drops:
                self._transport.drop(st.name, key)
        for ticket in submit:
            self._transport.submit(ticket)

    def _bad_expert(self, e: int):
        raise UserError(f"access_layer: expert id {e} out of range [0, {self._n_expert})")

    def _unknown_device(self, device: str):
        if self._expert_bytes is None:
            raise UserError("residency manager: no model bound yet (call bind_model first)")
        raise UserError(f"unknown device {device!r} (known: {', '.join(self._devices) or 'none'})")

    def release(self, access: LayerAccess) -> None:
        """End the leases of an access. Idempotent.

        Lock-free: one dict.pop is atomic under the GIL, and readers iterate a copy.
        """
        self._leases.pop(access.lease_id, None)

    # ---- prefetch and tickets ------------------------------------------------------------
    def prefetch(self, device: str, keys: Sequence[ExpertKey], phase: Phase) -> list[Ticket]:
        """Bring ``keys`` in ahead of demand where the eviction order allows; the tickets issued.

        Prefetch is speculative: it never evicts a leased expert or one the eviction policy
        ranks above the prefetched key, and it does nothing in MIXED batches.
        """
        st = self._devices.get(device)
        if st is None:
            self._unknown_device(device)
        if phase == Phase.MIXED:
            return []
        submit: list[Ticket] = []
        drops: list[ExpertKey] = []
        ne = self._n_expert
        with self._lock:
            issued = self._prefetch_flats(st, [k.layer * ne + k.expert for k in keys], phase,
                                          submit, drops, self._seq, self._other_leases(st, 0))
        self._after_unlock(st, submit, drops)
        return issued

    def _run_prefetch(self, st: DeviceState, prefetcher, layer: int, base: int, el: list[int],
                      phase: Phase, upcoming: UpcomingStep | None, submit: list,
                      drops: list, seq0: int, lease_id: int) -> None:
        if getattr(prefetcher, "needs_upcoming", False) and upcoming is None:
            raise UserError("access_layer: prefetch policy 'belady' is offline-only; "
                            "pass upcoming")
        nu = st.stats.next_use
        if upcoming is not None and nu is not None:
            # the upcoming step's elements are their keys' next uses (first occurrence wins)
            ubase = upcoming.layer * self._n_expert
            ue = list(upcoming.experts)
            ui = list(upcoming.access_index)
            for e, idx in zip(reversed(ue), reversed(ui)):
                nu[ubase + int(e)] = int(idx)
            if st.touch_each:
                for f in dict.fromkeys([ubase + int(e) for e in ue]):
                    if st.state[f] <= RESIDENT_MAX:
                        for order in st.touch_each:
                            order.touch(f)
        ctx = PrefetchContext(phase, layer, np.asarray(el), self._next_layers[layer], upcoming)
        flats = prefetcher.plan(ctx, st.stats)
        if flats:
            self._prefetch_flats(st, flats, phase, submit, drops, seq0,
                                 self._other_leases(st, lease_id))

    def _prefetch_flats(self, st: DeviceState, flats, phase: Phase, submit: list,
                        drops: list, seq0: int, others: set[int]) -> list[Ticket]:
        if st.capacity is None:
            return []
        order = st.phase_order[phase]
        last = st.stats.last_seq
        tally = st.tally[phase]
        keys, nbytes = st.keys, st.bytes_flat
        issued: list[Ticket] = []
        for flat in flats:
            if st.state[flat] != ABSENT:
                continue
            b = nbytes[flat]
            last[flat] = self._seq                   # a prefetch counts as a touch now
            self._seq += 1
            mine = order.key_of(flat)
            free = st.capacity - st.resident_bytes - st.pending_bytes
            victims: list[int] = []
            freed = 0
            while free + freed < b:
                v = order.pop_victim(seq0, others, st.pinned)
                if v is None:
                    break
                if order.key_of(v) >= mine:          # worth more than what we would bring in
                    order.unpop([v])
                    break
                victims.append(v)
                freed += nbytes[v]
            order.settle()
            if free + freed < b:
                order.unpop(victims)
                continue
            key = keys[flat]
            vkeys = tuple(keys[v] for v in victims)
            ticket = Ticket(self._next_ticket, st.name, key, b, vkeys, phase, True)
            self._next_ticket += 1
            tally.prefetch_issued += 1
            tally.prefetch_issued_bytes += b
            st.pinned.add(flat)
            st.pins_by_layer.setdefault(key.layer, []).append(flat)
            issued.append(ticket)
            if self._inline:
                for v in victims:
                    st.evict(v, tally)
                drops.extend(vkeys)
                st.make_resident(flat, phase, True)
            else:
                st.begin(ticket, flat, victims)
                submit.append(ticket)
        return issued

    def commit(self, ticket: Ticket) -> bool:
        """The transfer finished: the key is resident, its victims are gone. Idempotent."""
        with self._lock:
            st = self._devices[ticket.device]
            if st.finish(ticket.id) is None:
                return False
            tally = st.tally[ticket.phase]
            ne = self._n_expert
            for v in ticket.victims:
                st.evict(v.layer * ne + v.expert, tally)
            flat = ticket.key.layer * ne + ticket.key.expert
            st.stats.last_seq[flat] = self._seq      # arrival counts as a touch: keeps the
            self._seq += 1                           # recency order equal to access order
            st.make_resident(flat, ticket.phase, ticket.prefetch)
            if not ticket.prefetch:
                tally.admissions += 1
                tally.admitted_bytes += ticket.bytes
            self._cond.notify_all()
        if not self._drop_noop:
            for v in ticket.victims:
                self._transport.drop(ticket.device, v)
        return True

    def abort(self, ticket: Ticket) -> bool:
        """The transfer failed: the key stays absent, the victims stay resident. Idempotent."""
        with self._lock:
            st = self._devices[ticket.device]
            found = st.finish(ticket.id)
            if found is None:
                return False
            ne = self._n_expert
            st.unreserve([v.layer * ne + v.expert for v in ticket.victims], found[2])
            flat = ticket.key.layer * ne + ticket.key.expert
            st.state[flat] = ABSENT
            st.pinned.discard(flat)
            self._cond.notify_all()
        return True

    def wait(self, tickets: Sequence[Ticket], timeout: float | None = None) -> bool:
        """Block until every ticket has committed or aborted; False on timeout."""
        def done() -> bool:
            return all(t.id not in self._devices[t.device].tickets for t in tickets)
        with self._cond:
            return self._cond.wait_for(done, timeout)

    # ---- queries -------------------------------------------------------------------------
    def is_resident(self, device: str, key: ExpertKey) -> bool:
        st = self._devices[device]
        return st.state[key.layer * self._n_expert + key.expert] <= RESIDENT_MAX

    def resident_mask(self, device: str, layer: int) -> np.ndarray:
        """(n_expert,) bool: which experts of ``layer`` are resident on ``device`` (a copy)."""
        with self._lock:
            return self._devices[device].state_np[layer] <= RESIDENT_MAX

    def capacity(self, device: str) -> int | None:
        st = self._devices.get(device)
        return None if st is None else st.capacity

    def unresolved_reason(self, device: str) -> str | None:
        """Why nothing is admitted on ``device`` (None once its capacity is set)."""
        if self._expert_bytes is None:
            return "no model bound yet (bind_model)"
        st = self._devices.get(device)
        if st is None:
            return f"unknown device {device!r}"
        return st.reason or None

    @property
    def devices(self) -> tuple[str, ...]:
        return tuple(self._devices)

    def verify(self) -> None:
        """Assert every bookkeeping invariant (tests and debugging; O(experts))."""
        with self._lock:
            for st in self._devices.values():
                st.verify()

    def snapshot(self) -> ResidencySnapshot:
        """Counters and occupancy of every device, frozen."""
        with self._lock:
            return ResidencySnapshot(tuple(
                DeviceSnapshot(st.name, st.capacity, st.resident_bytes, st.resident_count,
                               len(st.tickets), st.pending_bytes,
                               tuple(t.freeze() for t in st.tally), st.reason)
                for st in self._devices.values()))
