"""Bookkeeping of one device: which experts are where, bytes, eviction orders, pins, counters.

Pure mechanism, no policy decisions and no locking: the manager calls these methods under its
lock. Keys are flat ints ``layer * n_expert + expert``.

Invariants (checked by ``verify``):
  * state[k] is 0..2 (resident, admitted in that Phase), ABSENT, PENDING (a ticket brings it
    in) or EVICTING (a victim of a pending ticket: no longer hit-able, its bytes inside the
    ticket's claim);
  * resident_bytes == sum of bytes of resident keys; pending_bytes == sum of the claims of
    pending tickets, a claim being max(ticket bytes, its victims' bytes);
  * resident_bytes + pending_bytes <= capacity (capacity None: nothing resident or pending);
  * every order holds each resident key (RecencyOrder exactly; ScoreHeap possibly with stale
    entries that are skipped by version and state).
"""
from __future__ import annotations

import numpy as np

from runtime.residency.ordering import RESIDENT_MAX, RecencyOrder, ScoreHeap
from runtime.residency.stats import UsageStats
from runtime.residency.telemetry import PhaseTally
from runtime.residency.types import ExpertKey, Ticket

ABSENT, PENDING, EVICTING = 8, 9, 10
MISSING = 11  # absent, and missed earlier in the current access_layer call (transient)


class DeviceState:
    def __init__(self, name: str, expert_bytes: np.ndarray, n_expert: int, evictors: list,
                 phase_evictor: tuple[int, int, int], stats: UsageStats):
        n_layer = len(expert_bytes)
        n_flat = n_layer * n_expert
        self.name = name
        self.n_expert = n_expert
        self.state = bytearray([ABSENT]) * n_flat                # per flat key
        self.state_np = np.frombuffer(self.state, dtype=np.uint8).reshape(n_layer, n_expert)
        self.bytes_flat: list[int] = np.repeat(expert_bytes, n_expert).tolist()
        self.keys = [ExpertKey(layer, e) for layer in range(n_layer) for e in range(n_expert)]
        self.version = [0] * n_flat
        self.capacity: int | None = None
        self.reason = "capacity not resolved yet (resolve_device() has not run)"
        self.resident_bytes = 0
        self.resident_count = 0
        self.pending_bytes = 0
        self.inflight: dict[int, Ticket] = {}        # flat -> ticket bringing it in
        # ticket id -> (ticket, claim bytes, the victims' states before the ticket)
        self.tickets: dict[int, tuple[Ticket, int, tuple[int, ...]]] = {}
        self.stats = stats
        self.orders = [RecencyOrder(p, stats) if p.name == "lru"
                       else ScoreHeap(p, stats, self.state, self.version) for p in evictors]
        self.phase_order = [self.orders[i] for i in phase_evictor]
        self.recency = [o for o in self.orders if isinstance(o, RecencyOrder)]
        self.heaps = [o for o in self.orders if isinstance(o, ScoreHeap)]
        # the lru order and its move_to_end, cached for the one-pass path
        self.lru_od = self.recency[0].od if self.recency else None
        self.lru_move = self.lru_od.move_to_end if self.recency else None
        # the lru order and the per-key state lru_step works on, in one attribute (these
        # objects are only ever changed in place); None without an lru order
        self.core = None if self.lru_od is None else (
            self.state, stats.last_seq, self.lru_od, self.lru_move, self.lru_od.popitem,
            self.keys, self.bytes_flat)
        self.touch_each = [o for o in self.orders if o.lazy and not o.policy.monotone]
        # lease id -> (flat key of the layer's expert 0, expert ids): experts in use here
        self.leases: dict[int, tuple[int, list[int]]] = {}
        self.pinned: set[int] = set()                # prefetched, not yet consumed
        self.pins_by_layer: dict[int, list[int]] = {}
        self.pf_unused = bytearray(n_flat)           # 1: prefetched, not hit yet
        self.n_pf_unused = 0
        self.tally = [PhaseTally(), PhaseTally(), PhaseTally()]
        self.lean = False  # set by the manager: the per-access loop needs only the order
        self.fast_policy = [False, False, False]  # per phase: policies allow the lru fast path
        self.fast = [False, False, False]         # ... and transport and capacity allow it
        self.static = False      # pin_static ran: pinned experts for good, nothing admitted
        self.static_bytes = 0    # bytes pinned by pin_static

    def free_bytes(self) -> int:
        if self.capacity is None:
            return 0
        return self.capacity - self.resident_bytes - self.pending_bytes

    # ---- state changes -------------------------------------------------------------------
    def make_resident(self, flat: int, phase: int, prefetched: bool,
                      in_recency: bool = False) -> None:
        """Absent/pending -> resident. ``in_recency``: the access loop already placed the key
        in the recency orders (a demand admission during its own access)."""
        self.state[flat] = phase
        self.version[flat] += 1
        self.resident_bytes += self.bytes_flat[flat]
        self.resident_count += 1
        if prefetched:
            self.pf_unused[flat] = 1
            self.n_pf_unused += 1
        for order in (self.heaps if in_recency else self.orders):
            order.add(flat)

    def evict(self, flat: int, tally: PhaseTally) -> None:
        """Resident (or evicting) -> absent; counts the eviction in ``tally``."""
        b = self.bytes_flat[flat]
        if self.state[flat] <= RESIDENT_MAX:
            self.resident_bytes -= b
            self.resident_count -= 1
            for order in self.recency:
                order.discard(flat)
        self.state[flat] = ABSENT
        tally.evictions += 1
        tally.evicted_bytes += b
        if self.pf_unused[flat]:
            self.pf_unused[flat] = 0
            self.n_pf_unused -= 1
            tally.prefetch_wasted_bytes += b

    def begin(self, ticket: Ticket, flat: int, victims: list[int]) -> None:
        """Reserve: victims stop being hit-able (bytes move into the claim), key pending."""
        victim_bytes = 0
        before = tuple(self.state[v] for v in victims)
        for v in victims:
            victim_bytes += self.bytes_flat[v]
            self.state[v] = EVICTING
            self.resident_count -= 1
            for order in self.recency:
                order.discard(v)
        self.resident_bytes -= victim_bytes
        claim = max(ticket.bytes, victim_bytes)
        self.pending_bytes += claim
        self.state[flat] = PENDING
        self.inflight[flat] = ticket
        self.tickets[ticket.id] = (ticket, claim, before)

    def finish(self, ticket_id: int) -> tuple[Ticket, int, tuple[int, ...]] | None:
        """Forget a pending ticket (None when it already finished)."""
        found = self.tickets.pop(ticket_id, None)
        if found is None:
            return None
        ticket, claim, _ = found
        self.pending_bytes -= claim
        del self.inflight[ticket.key.layer * self.n_expert + ticket.key.expert]
        return found

    def unreserve(self, flats: list[int], states: tuple[int, ...]) -> None:
        """An aborted ticket's victims become resident again, as they were."""
        for flat, state in zip(flats, states):
            self.state[flat] = state
            self.version[flat] += 1
            self.resident_bytes += self.bytes_flat[flat]
            self.resident_count += 1
        for order in self.orders:
            order.restore(flats)

    # ---- checks --------------------------------------------------------------------------
    def verify(self) -> None:
        st = np.frombuffer(self.state, dtype=np.uint8)
        resident = np.flatnonzero(st <= RESIDENT_MAX)
        nbytes = np.asarray(self.bytes_flat, dtype=np.int64)
        assert self.resident_count == len(resident), "resident count disagrees with membership"
        assert self.resident_bytes == int(nbytes[resident].sum()), "resident bytes disagree"
        claims = sum(c for _, c, _ in self.tickets.values())
        assert self.pending_bytes == claims, "pending bytes disagree with tickets"
        pending = set(np.flatnonzero(st == PENDING).tolist())
        assert pending == set(self.inflight), "pending keys disagree with tickets in flight"
        evicting = {v.layer * self.n_expert + v.expert
                    for t, _, _ in self.tickets.values() for v in t.victims}
        assert evicting == set(np.flatnonzero(st == EVICTING).tolist()), "evicting disagree"
        if self.capacity is None:
            assert self.resident_bytes == 0 and self.pending_bytes == 0
        else:
            assert self.resident_bytes + self.pending_bytes <= self.capacity, "over capacity"
        assert self.n_pf_unused == sum(self.pf_unused)
        for order in self.recency:
            order.rebuild_check(resident.tolist())
        for order in self.orders:
            if isinstance(order, ScoreHeap):
                live = {e[2] for e in order.heap
                        if e[3] == self.version[e[2]] and self.state[e[2]] <= RESIDENT_MAX}
                assert live == set(resident.tolist()), "heap lost a resident key"
