"""The residency manager's general access path: every policy, transport and lease state.

A mixin of ``ExpertResidencyManager`` (manager.py owns the state these methods use: the lock,
devices, leases, policies); ``access_layer`` (access_path.py) comes here whenever its
one-pass lru path does not apply. Both decide by the same rules; tests compare them.
"""
from __future__ import annotations

import math

import numpy as np

from runtime.errors import UserError
from runtime.residency.device_state import (ABSENT, EVICTING, MISSING, PENDING, RESIDENT_MAX,
                                            DeviceState)
from runtime.residency.policies.admission import AdmissionQuery
from runtime.residency.types import ExpertKey, LayerAccess, Phase, Ticket, UpcomingStep

_EMPTY: tuple = ()
_NO_KEYS: frozenset = frozenset()
_DECODE = int(Phase.DECODE)


class GeneralPathMixin:
    def _base_of(self, layer: int) -> int:
        """Flat key of (layer, expert 0); UserError for a layer without routed experts."""
        try:
            base = self._layer_base[layer]          # -1: dense layer
        except (IndexError, TypeError):
            base = -1
        if base < 0 or layer < 0:
            self._no_layer(layer)
        return base

    @staticmethod
    def _no_layer(layer: int):
        raise UserError(f"access_layer: layer {layer} has no routed experts in the model")

    def _access_general(self, st: DeviceState, device: str, layer: int, el: list[int],
                        phase: Phase, next_use, upcoming: UpcomingStep | None,
                        lease: bool) -> LayerAccess:
        """access_layer for every policy, transport and lease state."""
        if st.static:                         # pinned experts only (static.py)
            return self._access_static(st, device, layer, el, phase, lease)
        submit: list[Ticket] = []
        drops: list[ExpertKey] = []
        with self._lock:
            base = self._base_of(layer)
            self._check_experts(el)           # before anything changes
            if upcoming is None and getattr(self._prefetch[phase], "needs_upcoming", False):
                raise UserError("access_layer: prefetch policy 'belady' is offline-only; "
                                "pass upcoming")
            n = len(el)
            seq0 = seq = self._seq
            self._seq = seq + n
            if st.lean:                       # lru alone: the loop only records access order
                state, last = st.state, st.stats.last_seq
                od = st.recency[0].od
                move = od.move_to_end
                missed = None
                tr = 0
                for e in el:
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
            lease_id = self._take_lease(st, base, el, lease)
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
                access = LayerAccess(device, layer, phase, n, 0, 0, _EMPTY, _EMPTY, _EMPTY,
                                     _EMPTY, tr, lease_id)
            else:
                others = (_NO_KEYS if len(st.leases) <= (1 if lease_id else 0)
                          else self._other_leases(st, lease_id))
                misses, admitted, evicted, transient, tickets = self._handle_misses(
                    st, base, missed, phase, tally, submit, drops, seq0, others)
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

    def _touch_general(self, st: DeviceState, base: int, el: list[int], seq: int, phase: Phase,
                       next_use) -> tuple[list[int] | None, int]:
        """The per-element update when policies need more than the access order."""
        stats = st.stats
        state, last = st.state, stats.last_seq
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
        if len(st.leases) <= (1 if lease_id else 0):
            return _NO_KEYS
        held: set[int] = set()
        for other_id, (b, experts) in list(st.leases.items()):   # a copy: release is lock-free
            if other_id != lease_id:
                held.update([b + e for e in experts])
        return held

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

    def _check_experts(self, el: list[int]) -> None:
        """UserError for any expert id outside [0, n_expert), before anything changes."""
        ne = self._n_expert
        for e in el:
            if not 0 <= e < ne:
                self._bad_expert(e)

    def _take_lease(self, st, base: int, el: list[int], lease: bool) -> int:
        """A lease on ``el`` of layer ``base`` until release() (0: none); caller holds the lock.
        The lru fast path (access_path.py) inlines the same three lines for speed."""
        if not lease:
            return 0
        lease_id = self._next_lease
        self._next_lease = lease_id + 1
        st.leases[lease_id] = (base, el)
        return lease_id

    def _bad_expert(self, e):
        """Raise for an expert id outside [0, n_expert) (checked before anything changed,
        or undone by lru_step)."""
        raise UserError(f"access_layer: expert id {e} out of range [0, {self._n_expert})")
