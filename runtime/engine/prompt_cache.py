"""llama-server's host-memory prompt cache (``--cache-ram N``, tools/server/server-task.cpp).

With ``-np N`` a slot's KV holds the last prompt it served; when a request takes a slot whose
KV it would mostly throw away, the scheduler first copies that KV state into host memory
here, then loads into the slot the cached state that shares the most of the new prompt. A
conversation that comes back after other requests took its slot then evaluates only its new
tokens. With ``cache_idle_slots`` (llama-server's default) every idle slot is copied here when
a request starts (and, with ``--kv-unified``, emptied, giving its cells to the pool).

This module only keeps the entries and chooses (no llama.cpp calls): the scheduler reads and
writes the sequence state (runtime/engine/slot_state.py) and passes bytes in and out.

    cache = PromptCache(limit_bytes=256 << 20)
    if cache.can_store(tokens, n_bytes):
        cache.store(tokens, state)
    index = cache.best_for(prompt, slot_tokens)      # None: keep what the slot holds
    entry = cache.take(index)                        # load entry.state into the slot
"""
from __future__ import annotations

from dataclasses import dataclass

MIN_KEEP = 0.25     # a cached prompt is loaded only if the new one keeps this much of it


@dataclass(frozen=True, slots=True)
class CachedPrompt:
    """One slot's KV state in host memory and the tokens it holds."""

    tokens: tuple[int, ...]
    state: bytes                 # llama_state_seq_get_data of the sequence

    @property
    def n_bytes(self) -> int:
        return len(self.state)


def common_prefix(a: tuple[int, ...] | list[int], b: tuple[int, ...] | list[int]) -> int:
    """How many tokens ``a`` and ``b`` share from the start (the engine's prefix reuse, the
    slots' and this cache's choices all count with it)."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


class PromptCache:
    """Cached prompt states, oldest first, within ``limit_bytes`` (0: no limit)."""

    def __init__(self, limit_bytes: int) -> None:
        if limit_bytes < 0:
            raise ValueError("limit_bytes must be >= 0 (0: no limit)")
        self.limit_bytes = limit_bytes
        self._entries: list[CachedPrompt] = []       # oldest first
        self.stored = 0                              # entries stored since start
        self.loaded = 0                              # entries taken back into a slot

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def size_bytes(self) -> int:
        return sum(e.n_bytes for e in self._entries)

    def entries(self) -> tuple[CachedPrompt, ...]:
        return tuple(self._entries)

    def can_store(self, tokens: list[int] | tuple[int, ...], n_bytes: int) -> bool:
        """Whether ``store`` would keep a state of ``n_bytes`` for ``tokens``: not when they
        are empty, already held whole by an entry, or larger than the limit."""
        if not tokens:
            return False
        if any(common_prefix(e.tokens, tokens) == len(tokens) for e in self._entries):
            return False
        return self.limit_bytes == 0 or n_bytes <= self.limit_bytes

    def store(self, tokens: list[int] | tuple[int, ...], state: bytes) -> None:
        """Keep ``state``; entries it holds whole are dropped, then the oldest until it fits."""
        assert self.can_store(tokens, len(state))
        entry = CachedPrompt(tuple(tokens), bytes(state))
        self._entries = [e for e in self._entries
                         if common_prefix(e.tokens, entry.tokens) != len(e.tokens)]
        if self.limit_bytes:
            while self._entries and self.size_bytes + entry.n_bytes > self.limit_bytes:
                self._entries.pop(0)
        self._entries.append(entry)
        self.stored += 1
        assert self.limit_bytes == 0 or self.size_bytes <= self.limit_bytes

    def best_for(self, tokens: list[int], current: list[int]) -> int | None:
        """The entry to load for a prompt of ``tokens`` into a slot that holds ``current``:
        the one sharing the most of the prompt while keeping more of itself than the slot
        keeps of ``current`` (and at least MIN_KEEP of itself); None: none is better."""
        if not tokens:
            return None
        lcp = common_prefix(current, tokens)
        keep_best = lcp / len(current) if current else -1.0   # an empty slot: any entry wins
        sim_best = lcp / len(tokens)
        best = None
        for i, entry in enumerate(self._entries):
            lcp = common_prefix(entry.tokens, tokens)
            keep, sim = lcp / len(entry.tokens), lcp / len(tokens)
            if keep >= MIN_KEEP and keep > keep_best and sim > sim_best:
                keep_best, sim_best, best = keep, sim, i
        return best

    def take(self, index: int) -> CachedPrompt:
        """Remove entry ``index`` (it moves into a slot) and return it."""
        self.loaded += 1
        return self._entries.pop(index)
