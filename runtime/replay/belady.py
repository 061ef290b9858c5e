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

import heapq
from dataclasses import dataclass

import numpy as np

from runtime.traces.trace import PHASE_PREFILL, RouteTrace

NEVER = 2**62  # next_use of an access whose key is never used again


def next_use(trace: RouteTrace) -> np.ndarray:
    """(n,) int64: index of the next access to the same key, ``NEVER`` for the last one."""
    keys = trace.keys()
    order = np.argsort(keys, kind="stable")   # accesses grouped by key, in time order
    same = keys[order[1:]] == keys[order[:-1]]
    out = np.full(len(keys), NEVER, dtype=np.int64)
    out[order[:-1][same]] = order[1:][same]
    return out


def cold_miss_bytes(trace: RouteTrace) -> int:
    """Bytes of the distinct keys in ``trace``: the first touch of each must miss."""
    keys = np.unique(trace.keys())
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
    """Belady under forced admission, with per-call leases.

    Per layer batch: keys resident at entry are hits; every key of the batch is leased; each
    distinct missed key (routing order) is admitted by evicting unleased residents with the
    farthest next use (ties: older last access, then layer, expert) until it fits, or used
    transiently when even evicting every unleased resident would not make room.
    """
    if nxt is None:
        nxt = next_use(trace)
    n_expert = trace.header.n_expert
    key_bytes = [int(b) for b in trace.header.expert_bytes]
    bounds = trace.batch_bounds().tolist()
    keys = trace.keys().tolist()
    nxt_l = nxt.tolist()
    phases = trace.phase.tolist()
    resident: dict[int, tuple[int, int]] = {}   # key -> (next use, last access seq)
    heap: list[tuple[int, int, int, int]] = []  # (-next use, last seq, layer, expert), lazy
    free = capacity_bytes
    misses = [0, 0]
    miss_bytes = [0, 0]
    transient = [0, 0]
    for b in range(len(bounds) - 1):
        s, e = bounds[b], bounds[b + 1]
        ph = 0 if phases[s] == PHASE_PREFILL else 1
        last: dict[int, int] = {}                # key -> index of its last element in the call
        for i in range(s, e):
            last[keys[i]] = i
        missed = [k for k in last if k not in resident]
        leased_bytes = 0                         # bytes of this call's resident keys
        for k, i in last.items():                # refresh the hits' priorities
            if k in resident:
                leased_bytes += key_bytes[k // n_expert]
                resident[k] = (nxt_l[i], i)
                heapq.heappush(heap, (-nxt_l[i], i, k // n_expert, k % n_expert))
        # misses in routing order: dict preserves first-insertion order = first occurrence
        for k in missed:
            size = key_bytes[k // n_expert]
            misses[ph] += 1
            miss_bytes[ph] += size
            if free < size:
                if capacity_bytes - leased_bytes < size:  # free + every unleased resident
                    transient[ph] += 1
                    continue
                held = []
                while free < size:
                    entry = heapq.heappop(heap)
                    victim = entry[2] * n_expert + entry[3]
                    cur = resident.get(victim)
                    if cur is None or cur != (-entry[0], entry[1]):
                        continue                 # stale entry
                    if victim in last:
                        held.append(entry)       # leased by this call
                        continue
                    del resident[victim]
                    free += key_bytes[entry[2]]
                for entry in held:
                    heapq.heappush(heap, entry)
            i = last[k]
            resident[k] = (nxt_l[i], i)
            heapq.heappush(heap, (-nxt_l[i], i, k // n_expert, k % n_expert))
            free -= size
            leased_bytes += size
    return BoundResult(misses=(misses[0], misses[1]),
                       demand_miss_bytes=(miss_bytes[0], miss_bytes[1]),
                       transient=(transient[0], transient[1]))
