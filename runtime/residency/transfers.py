"""Prefetch and transfer tickets of the residency manager (commit, abort, wait).

A mixin of ``ExpertResidencyManager``; see manager.py for the state it uses.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from runtime.residency.device_state import ABSENT, RESIDENT_MAX, DeviceState
from runtime.residency.policies.prefetch import PrefetchContext
from runtime.residency.types import ExpertKey, Phase, Ticket, UpcomingStep


class TransfersMixin:
    def prefetch(self, device: str, keys: Sequence[ExpertKey], phase: Phase) -> list[Ticket]:
        """Bring ``keys`` in ahead of demand where the eviction order allows; the tickets issued.

        Prefetch is speculative: it never evicts a leased expert or one the eviction policy
        ranks above the prefetched key, and it does nothing in MIXED batches.
        """
        st = self._devices.get(device)
        if st is None:
            self._unknown_device(device)
        if phase == Phase.MIXED or st.static:   # nothing moves onto a static device
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
