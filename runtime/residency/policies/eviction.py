"""Eviction policies: a score per resident expert; the lowest is evicted first.

The manager breaks ties with the total order (score, last access seq, layer, expert), so a
policy only says how much an expert is worth. ``monotone`` policies promise that a key's score
never drops as it is accessed, which lets the manager refresh stale heap entries lazily.
"""
from __future__ import annotations

import math

from runtime.residency.stats import UsageStats


class Lru:
    """Least recently used: score = last access sequence number."""

    name = "lru"
    monotone = True
    needs_uses = False
    decay_rate = 0.0
    needs_next_use = False

    def score(self, stats: UsageStats, flat: int) -> float:
        return stats.last_seq[flat]


class Lfu:
    """Least frequently used (counts over the device's whole history), recency tie-break."""

    name = "lfu"
    monotone = True
    needs_uses = True
    decay_rate = 0.0
    needs_next_use = False

    def score(self, stats: UsageStats, flat: int) -> float:
        return stats.uses_of(flat)


class LfuDecay:
    """Exponentially decayed use counts: a use ``half_life`` accesses ago counts half."""

    name = "lfu-decay"
    monotone = True
    needs_uses = False
    needs_next_use = False

    def __init__(self, half_life: float = 4096.0):
        self.decay_rate = math.log(2.0) / half_life  # per access

    def score(self, stats: UsageStats, flat: int) -> float:
        return stats.decay_log[flat]


class PhaseWeighted:
    """Utility = w_prefill * prefill uses + w_decode * decode (and mixed) uses."""

    name = "phase-weighted"
    monotone = True  # weights are >= 0 (validated), so utility only grows
    needs_uses = True
    decay_rate = 0.0
    needs_next_use = False

    def __init__(self, w_prefill: float = 1.0, w_decode: float = 4.0):
        self.w_prefill = w_prefill
        self.w_decode = w_decode

    def score(self, stats: UsageStats, flat: int) -> float:
        u, n = stats.uses, stats.n_flat
        return self.w_prefill * u[flat] + self.w_decode * (u[n + flat] + u[2 * n + flat])


class Belady:
    """Offline optimum: evict the expert whose next use is farthest (needs next_use)."""

    name = "belady"
    monotone = False  # an access moves the next use later: the manager re-pushes on access
    needs_uses = False
    decay_rate = 0.0
    needs_next_use = True

    def score(self, stats: UsageStats, flat: int) -> float:
        return -stats.next_use[flat]
