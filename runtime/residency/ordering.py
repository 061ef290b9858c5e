"""Eviction candidate orders: the resident experts of a device sorted by the total order
(policy score, last access seq, layer, expert), lowest first, without scanning all of them.

``RecencyOrder`` serves lru (score == last access seq): an OrderedDict kept in access order.
``ScoreHeap`` serves every scored policy: a heap with lazy invalidation. Both answer
``pop_victim`` in amortized O(log n) and skip leased and pinned experts.
"""
from __future__ import annotations

import heapq
from collections import OrderedDict

from runtime.residency.stats import UsageStats

RESIDENT_MAX = 2  # state values 0..2 are resident (the admitting Phase)


class RecencyOrder:
    """lru: resident keys in last-access order (the manager touches them in seq order)."""

    lazy = False  # membership is exact: evicted keys are removed

    def __init__(self, policy, stats: UsageStats):
        self.policy = policy
        self.stats = stats
        self.od: OrderedDict[int, None] = OrderedDict()

    def key_of(self, flat: int) -> tuple:
        seq = self.stats.last_seq[flat]
        return (seq, seq, flat)

    def add(self, flat: int) -> None:
        """A newly resident key (its last_seq is the newest)."""
        self.od[flat] = None

    def discard(self, flat: int) -> None:
        self.od.pop(flat, None)

    def pop_victim(self, min_seq: int, others: set[int], pinned: set[int]) -> int | None:
        """The least recent key not protected: keys touched at or after ``min_seq`` (the
        current call), in ``others`` (other leases) or ``pinned`` (prefetched) are skipped."""
        last = self.stats.last_seq
        for flat in self.od:
            if last[flat] >= min_seq:
                return None          # everything from here on is newer
            if flat in others or flat in pinned:
                continue
            break
        else:
            return None
        del self.od[flat]
        return flat

    def settle(self) -> None:
        return None

    def unpop(self, flats: list[int]) -> None:
        """Put popped victims back where they were: merged by (last_seq, flat) with the
        leased/pinned keys that ``pop_victim`` skipped at the front."""
        if not flats:
            return
        last, od = self.stats.last_seq, self.od
        limit = max((last[f], f) for f in flats)
        front = []
        for f in od:
            if (last[f], f) > limit:
                break
            front.append(f)
        for f in front:
            del od[f]
        for f in sorted(front + flats, key=lambda f: (last[f], f), reverse=True):
            od[f] = None
            od.move_to_end(f, last=False)

    def restore(self, flats: list[int]) -> None:
        """Keys resident again (an aborted ticket's victims): re-sort by last access."""
        seq = self.stats.last_seq
        merged = sorted([*self.od, *flats], key=lambda f: (seq[f], f))
        self.od.clear()                 # in place: the manager caches this object
        self.od.update(dict.fromkeys(merged))

    def rebuild_check(self, resident: list[int]) -> None:
        seq = self.stats.last_seq
        assert list(self.od) == sorted(resident, key=lambda f: (seq[f], f)), "lru order broken"


class ScoreHeap:
    """Scored policies: entries (score, last_seq, flat, version); stale ones are dropped, or
    refreshed in place for monotone policies (a score that only grows can be re-read late)."""

    lazy = True

    def __init__(self, policy, stats: UsageStats, state: bytearray, version: list[int]):
        self.policy = policy
        self.stats = stats
        self.state = state
        self.version = version
        self.heap: list[tuple] = []
        self.aside: list[tuple] = []

    def key_of(self, flat: int) -> tuple:
        return (self.policy.score(self.stats, flat), self.stats.last_seq[flat], flat)

    def add(self, flat: int) -> None:
        heapq.heappush(self.heap, (*self.key_of(flat), self.version[flat]))

    def discard(self, flat: int) -> None:
        return None  # lazily: entries of non-resident keys are dropped when they surface

    def pop_victim(self, min_seq: int, others: set[int], pinned: set[int]) -> int | None:
        """Lowest valid entry not protected (see RecencyOrder.pop_victim)."""
        heap, state, version = self.heap, self.state, self.version
        policy, stats, last_seq = self.policy, self.stats, self.stats.last_seq
        while heap:
            entry = heap[0]
            flat = entry[2]
            if entry[3] != version[flat] or state[flat] > RESIDENT_MAX:
                heapq.heappop(heap)
                continue
            score = policy.score(stats, flat)
            seq = last_seq[flat]
            if score != entry[0] or seq != entry[1]:
                if policy.monotone:
                    heapq.heapreplace(heap, (score, seq, flat, entry[3]))
                else:  # a fresher entry was pushed when the key was accessed
                    heapq.heappop(heap)
                continue
            heapq.heappop(heap)
            if seq >= min_seq or flat in others or flat in pinned:
                self.aside.append(entry)
                continue
            return flat
        return None

    def settle(self) -> None:
        """Push back the leased/pinned candidates skipped by the last searches."""
        for entry in self.aside:
            heapq.heappush(self.heap, entry)
        self.aside.clear()

    def unpop(self, flats: list[int]) -> None:
        for flat in flats:
            self.add(flat)

    def restore(self, flats: list[int]) -> None:
        for flat in flats:
            self.add(flat)

    def touch(self, flat: int) -> None:
        """Non-monotone policies: the key's score moved; push a fresh entry."""
        heapq.heappush(self.heap, (*self.key_of(flat), self.version[flat]))
