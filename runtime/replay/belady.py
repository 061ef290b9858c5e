"""Offline facts about a trace that bound every policy: next uses, cold misses, forced Belady.

* ``next_use(trace)`` feeds the manager's offline policies (eviction ``belady``, admission
  ``belady-bypass``, prefetch ``belady``): for each access, the index of the next access to the
  same (layer, expert) key, or ``NEVER``.
* ``cold_miss_bytes(trace)``: every key's first touch misses in any policy that starts empty,
  so the bytes of the distinct keys are a floor under every policy's demand-miss bytes.
* ``forced_belady(trace, capacity)``: Belady's eviction (farthest next use first) under forced
  admission, written here independently of the manager as a plain loop, with the manager's
  access semantics (``docs/design/contracts.md``, "Access semantics"). The manager's
  ``belady`` (with bypass) may decline admissions, so it should never do worse than this.
"""
from __future__ import annotations

import gc
import heapq
from collections import deque
from dataclasses import dataclass

import numpy as np

from runtime.clib import load_library
from runtime.traces.trace import PHASE_PREFILL, RouteTrace

NEVER = 2**62  # next_use of an access whose key is never used again


def next_use(trace: RouteTrace) -> np.ndarray:
    """(n,) int64: index of the next access to the same key, ``NEVER`` for the last one.
    One backward pass in the residency core's library (``rc_next_use``)."""
    lib, ffi = load_library()
    keys = np.ascontiguousarray(trace.keys(), dtype=np.int64)
    out = np.empty(len(keys), dtype=np.int64)
    n_keys = trace.header.n_layer * trace.header.n_expert
    lib.rc_next_use(ffi.from_buffer("int64_t[]", keys), len(keys), n_keys, NEVER,
                    ffi.from_buffer("int64_t[]", out))
    return out


def cold_miss_bytes(trace: RouteTrace) -> int:
    """Bytes of the distinct keys in ``trace``: the first touch of each must miss."""
    seen = np.bincount(trace.keys(), minlength=trace.header.n_layer * trace.header.n_expert)
    keys = np.flatnonzero(seen)
    layer = keys // trace.header.n_expert
    return int(np.asarray(trace.header.expert_bytes, dtype=np.int64)[layer].sum())


@dataclass(frozen=True)
class BoundResult:
    """Demand misses of an offline reference run, per phase (index 0 prefill, 1 decode)."""

    misses: tuple[int, int]
    demand_miss_bytes: tuple[int, int]
    transient: tuple[int, int]

    @property
    def total_demand_miss_bytes(self) -> int:
        return sum(self.demand_miss_bytes)


def forced_belady(trace: RouteTrace, capacity_bytes: int,
                  nxt: np.ndarray | None = None) -> BoundResult:
    """Belady's eviction under forced admission: every miss that fits is admitted."""
    return offline_belady(trace, capacity_bytes, nxt, bypass=False)


def belady_ceiling(trace: RouteTrace, capacity_bytes: int,
                   nxt: np.ndarray | None = None) -> BoundResult:
    """Belady's eviction with bypass: a miss is declined when its next use lies beyond the
    next use of the first victim it would evict (the one used farthest in the future)."""
    return offline_belady(trace, capacity_bytes, nxt, bypass=True)


def offline_belady(trace: RouteTrace, capacity_bytes: int, nxt: np.ndarray | None = None, *,
                   bypass: bool) -> BoundResult:
    """Belady with per-batch leases, as a plain loop over the trace.

    Per layer batch: keys resident at entry hit; every key of the batch is leased; each
    distinct missed key (routing order) evicts unleased residents in the order (next use
    farthest first; among keys never used again, least recently used first; then layer,
    expert) until it fits, or is used transiently when the unleased residents are too few
    (or, with ``bypass``, when its own next use is not sooner than the first victim's).

    Residents are indexed by their next use instead of a priority queue of tuples: the
    resident whose next use is access ``p`` is ``owner[p]`` (each access is the next use of at
    most one earlier access), a heap of ``-p`` finds the farthest, and keys never used again
    wait in a FIFO that is already in last-access order.
    """
    enabled = gc.isenabled()
    gc.disable()  # the loop makes only acyclic garbage; see harness._drive
    try:
        return _offline_belady(trace, capacity_bytes, nxt, bypass)
    finally:
        if enabled:
            gc.enable()


def _offline_belady(trace: RouteTrace, capacity_bytes: int, nxt: np.ndarray | None,
                    bypass: bool) -> BoundResult:
    if nxt is None:
        nxt = next_use(trace)
    h = trace.header
    ne = h.n_expert
    size_of_layer = [int(b) for b in h.expert_bytes]
    bounds = trace.batch_bounds().tolist()
    starts = bounds[:-1]
    batch_layer = trace.layer[starts].tolist() if len(starts) else []
    batch_phase = [0 if p == PHASE_PREFILL else 1 for p in trace.phase[starts].tolist()]
    multi = (np.diff(bounds) > h.n_expert_used).tolist()
    flat = trace.keys().tolist()                       # (n,) layer * n_expert + expert
    nul = nxt.tolist()
    n_flat = h.n_layer * ne
    resident = bytearray(n_flat)
    nu_of = [0] * n_flat                                # current next use of each key
    owner = [-1] * len(nul)                             # next-use position -> key
    far: list[int] = []                                 # heap of -position (lazy)
    never: deque[int] = deque()                         # residents never used again, LRU first
    push, pop = heapq.heappush, heapq.heappop
    used = 0                                            # resident bytes
    misses = [0, 0]
    miss_bytes = [0, 0]
    transient = [0, 0]
    for b in range(len(starts)):
        s, e = bounds[b], bounds[b + 1]
        ph = batch_phase[b]
        size = size_of_layer[batch_layer[b]]
        missed: list[int] = []
        for i in range(s, e):
            f = flat[i]
            nu_of[f] = nul[i]                           # the last occurrence wins
            if not resident[f]:
                missed.append(f)
        if multi[b]:                                    # repeated keys: distinct ones,
            last = {f: i for i, f in enumerate(flat[s:e])}
            order = sorted(last, key=last.get)          # by last occurrence
            missed = list(dict.fromkeys(missed))        # by first occurrence
        else:
            order = flat[s:e]
        for f in missed:
            misses[ph] += 1
            miss_bytes[ph] += size
            if capacity_bytes - used >= size:
                resident[f] = 1
                used += size
                continue
            # Victims. The batch's own keys are leased; they need no check here: they are
            # registered only after the batch, and their earlier entries went stale when
            # their next use moved on (above).
            victims: list[tuple[int, int]] = []         # (key, its next use)
            freed = 0
            while capacity_bytes - used + freed < size:
                if never:
                    v = never.popleft()
                    if not resident[v]:
                        continue                        # stale: evicted earlier
                    victims.append((v, NEVER))
                elif far:
                    p = -pop(far)
                    v = owner[p]
                    if not resident[v] or nu_of[v] != p:
                        continue                        # stale
                    victims.append((v, p))
                else:
                    break
                freed += size_of_layer[v // ne]
            ok = capacity_bytes - used + freed >= size
            if ok and bypass and not nu_of[f] < victims[0][1]:
                ok = False
            if not ok:                                  # put the victims back where they were
                never.extendleft(v for v, p in reversed(victims) if p == NEVER)
                for v, p in victims:
                    if p != NEVER:
                        push(far, -p)
                transient[ph] += 1
                continue
            for v, _ in victims:
                resident[v] = 0
            used += size - freed
            resident[f] = 1
        for f in order:                                 # (re-)register this batch's residents
            if resident[f]:
                p = nu_of[f]
                if p == NEVER:
                    never.append(f)
                else:
                    owner[p] = f
                    push(far, -p)
    return BoundResult(misses=(misses[0], misses[1]),
                       demand_miss_bytes=(miss_bytes[0], miss_bytes[1]),
                       transient=(transient[0], transient[1]))

