"""The residency manager's hot path: ``access_layer`` and demand-miss handling.

A mixin of ``ExpertResidencyManager`` (manager.py owns the state these methods use: the lock,
devices, leases, policies). Every path here decides by the same rules; the one-pass lru path
is a shortcut that tests compare against the general one.
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
_new_tuple = tuple.__new__  # builds a LayerAccess without its Python-level __new__


class AccessPathMixin:
    def access_layer(self, device: str, layer: int, experts, phase: Phase, *,
                     step: int = 0, next_use=None, upcoming: UpcomingStep | None = None,
                     lease: bool = True, release: LayerAccess | None = None) -> LayerAccess:
        """Record one layer-step's routed experts; see contracts.md ("Residency").

        experts: (n_tokens * k,) int expert ids in routing order, each in [0, n_expert)
        (ndarray or list). next_use: same shape, the access index of each element's next use
        (offline policies only). With ``lease`` the experts stay leased until
        ``release(access)``; ``lease=False`` holds them only during this call (replay).
        ``release``: an earlier access whose leases end first, under the same lock
        acquisition (the live hooks end the previous layer-step's lease this way); exactly
        ``release(that)`` followed by this call.
        """
        st = self._devices.get(device)
        if st is None:
            self._unknown_device(device)
        el = experts if type(experts) is list else experts.tolist()
        lock = self._lock
        lock.acquire()
        try:
            if release is not None:
                self._leases.pop(release.lease_id, None)
            if not st.fast[phase] or self._leases or st.tickets or st.n_pf_unused \
                    or st.pins_by_layer:
                access = None                            # the general path, below
            else:
                # The one-pass lru path: lru alone, admit always, no prefetch, inline
                # transport, nothing leased, pinned or in flight (replay, and the live decode
                # loop between layers). It decides exactly as the general path (tests compare
                # them): every element touches its key in routing order (a missed key is
                # placed in the order at its first access and marked resident at once, so
                # its repeats are hits), then the misses are admitted in routing order, each
                # evicting the least recent keys not touched by this call.
                try:
                    base, flat_of = self._layer_flat[layer]  # flat_of: {expert id: flat key}
                except (IndexError, TypeError):
                    base = -1
                if base < 0 or layer < 0:
                    self._no_layer(layer)
                seq0 = seq = self._seq
                n = len(el)
                self._seq = seq + n
                state, last, move, od = st.state, st.stats.last_seq, st.lru_move, st.lru_od
                keys = st.keys
                tr = 0                                   # hits on keys admitted in PREFILL
                missed = None                            # ExpertKeys, routing order
                e = None
                try:
                    for e in el:
                        f = flat_of[e]                   # KeyError: not in [0, n_expert)
                        s = state[f]
                        if s == 8:                       # ABSENT: a demand miss
                            state[f] = phase
                            od[f] = None
                            if missed is None:
                                missed = [keys[f]]
                            else:
                                missed.append(keys[f])
                        else:                            # resident: no tickets on this path
                            if s == 0:
                                tr += 1
                            move(f)
                        last[f] = seq
                        seq += 1
                except (KeyError, TypeError):
                    self._bad_expert_fast(st, base, e, missed)
                if phase != 1:                           # transition hits: decode only
                    tr = 0
                lease_id = 0
                if lease:
                    lease_id = self._next_lease
                    self._next_lease = lease_id + 1
                    self._leases[lease_id] = (st, base, el)
                tally = st.tally[phase]
                tally.accesses += n
                if tr:
                    tally.transition_hits += tr
                if missed is None:                       # all hit
                    tally.hits += n
                    return _new_tuple(LayerAccess, (device, layer, phase, n, 0, 0, _EMPTY,
                                                    _EMPTY, _EMPTY, _EMPTY, tr, lease_id))
                m = len(missed)
                b = st.bytes_flat[base]                  # bytes of one expert of this layer
                mb = m * b
                need = mb - st.capacity + st.resident_bytes      # bytes to free
                if need <= 0:
                    evicted = _EMPTY
                    freed = n_ev = 0
                else:
                    # the victims of all m admissions together: the shortest prefix of the
                    # order that frees ``need`` bytes (what admitting one by one takes). The
                    # order is sorted by last access, so if its newest victim was not touched
                    # by this call, none was.
                    popitem, nbytes = od.popitem, st.bytes_flat
                    victims = []
                    freed = 0
                    while freed < need:                  # the order holds >= m * b bytes
                        v = popitem(False)[0]
                        victims.append(v)
                        freed += nbytes[v]
                    if last[v] >= seq0:                  # too few unleased keys: one by one
                        for v in reversed(victims):
                            od[v] = None
                            od.move_to_end(v, last=False)
                        access, evicted = self._admit_each(
                            st, device, layer, base, [base + k.expert for k in missed], n,
                            phase, seq0, tr, lease_id, tally)
                        if not evicted or self._drop_noop:
                            return access
                        m = 0                            # counted: skip the block below
                    else:
                        evicted = []
                        for v in victims:
                            state[v] = 8                 # ABSENT
                            evicted.append(keys[v])
                        evicted = tuple(evicted)
                        n_ev = len(evicted)
                        tally.evictions += n_ev
                        tally.evicted_bytes += freed
                if m:
                    st.resident_bytes += mb - freed
                    st.resident_count += m - n_ev
                    tally.hits += n - m
                    tally.misses += m
                    tally.demand_miss_bytes += mb
                    tally.admissions += m
                    tally.admitted_bytes += mb
                    access = _new_tuple(LayerAccess, (device, layer, phase, n - m, m, mb,
                                                      tuple(missed), evicted, _EMPTY, _EMPTY,
                                                      tr, lease_id))
                    if not evicted or self._drop_noop:
                        return access
        finally:
            lock.release()
        if access is None:
            return self._access_general(st, device, layer, el, phase, next_use, upcoming, lease)
        drop = self._transport.drop                      # never call out under the lock
        for key in evicted:
            drop(device, key)
        return access

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
        submit: list[Ticket] = []
        drops: list[ExpertKey] = []
        with self._lock:
            base = self._base_of(layer)
            ne = self._n_expert
            for e in el:                      # before anything changes
                if not 0 <= e < ne:
                    self._bad_expert(st, base, el, e)
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

    def _admit_each(self, st: DeviceState, device: str, layer: int, base: int,
                    missed: list[int], n: int, phase: Phase, seq0: int, tr: int,
                    lease_id: int, tally) -> tuple[LayerAccess, tuple]:
        """The misses of a one-pass lru call when the unleased keys cannot make room for all
        of them (flat keys in routing order, each placed in the order at its access and
        marked resident), admitted one by one in routing order, each evicting the least recent
        keys not touched by this call; a miss that cannot fit is used transiently.
        Returns (the access, the evicted keys)."""
        state, last, keys, nbytes = st.state, st.stats.last_seq, st.keys, st.bytes_flat
        od = st.lru_od
        b = nbytes[base]
        free = st.capacity - st.resident_bytes
        admitted = []
        evicted = []
        transient = None
        evicted_bytes = 0
        popitem = od.popitem
        for f in missed:
            if free < b:
                v = popitem(False)[0]                # the least recent key
                bv = nbytes[v]
                if free + bv >= b and last[v] < seq0:    # one victim suffices: the usual case
                    state[v] = ABSENT
                    evicted.append(keys[v])
                    free += bv - b
                    evicted_bytes += bv
                    state[f] = phase
                    admitted.append(keys[f])
                    continue
                od[v] = None                         # put it back; take the general route
                od.move_to_end(v, last=False)
                victims = []
                freed = 0
                while free + freed < b:
                    v = popitem(False)[0]            # the least recent key
                    if last[v] >= seq0:              # touched by this call: so is the rest
                        od[v] = None
                        od.move_to_end(v, last=False)
                        break
                    victims.append(v)
                    freed += nbytes[v]
                if free + freed < b:                 # cannot fit: evict nothing, use it once
                    for v in reversed(victims):
                        od[v] = None
                        od.move_to_end(v, last=False)
                    state[f] = ABSENT
                    del od[f]
                    if transient is None:
                        transient = [keys[f]]
                    else:
                        transient.append(keys[f])
                    continue
                for v in victims:
                    state[v] = ABSENT
                    evicted.append(keys[v])
                free += freed
                evicted_bytes += freed
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
            evicted = tuple(evicted)
        else:
            evicted = _EMPTY
        return _new_tuple(LayerAccess, (device, layer, phase, n - misses, misses, misses * b,
                                        tuple(admitted), evicted, transient or _EMPTY, _EMPTY,
                                        tr, lease_id)), evicted

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

    def _bad_expert_fast(self, st: DeviceState, base: int, e, missed: list | None):
        """The one-pass path's _bad_expert: its misses so far (ExpertKeys, marked resident and
        placed in the order) go back to absent, then raise."""
        for key in missed or ():
            st.state[base + key.expert] = ABSENT
            self._unplace(st, base + key.expert)
        self._bad_expert(st, 0, [], e)

    def _bad_expert(self, st: DeviceState, base: int, el: list[int], e: int):
        """Undo the call's marks (missed keys placed in the order) and raise. The access order
        of the elements before ``e`` stays touched; nothing else changed."""
        ne = self._n_expert
        for x in el:
            if 0 <= x < ne and st.state[base + x] == MISSING:
                st.state[base + x] = ABSENT
                self._unplace(st, base + x)
        raise UserError(f"access_layer: expert id {e} out of range [0, {ne})")
