"""Honest timing of prefetches in replay: a prefetch is a hit only if it arrived in time.

The residency core decides as if every transfer landed at once (the rule replay = runtime
rests on: no decision depends on when a copy lands). What a prefetch is worth does depend on
it, so replay prices it afterwards, on a clock built from the cost model:

* Batch b (one layer-step) starts at T[b] and computes for d[b] seconds: its dense part
  (attention, router: ``gpu(dense_bytes, tokens)``), then its experts (a hit ``gpu(b, m)``,
  a demand miss the cheaper of fetching and computing on the CPU). d is the cost model's.
* Prefetches cross the host->device link one after another (a FIFO queue at ``link_gbps``
  with ``link_latency_us`` per transfer), ahead of the copies of demand admissions: those are
  off the critical path (the miss already ran) and yield to a prefetch; the cost model
  charges them to the phase's link time. Batch b's prefetches join the queue when its
  routing is known, at T[b] + dense[b], in issue order.
* A prefetched expert first used in batch u is on time when its transfer finished by
  T[u] + dense[u] (when u's expert matmuls start); otherwise it is LATE: counted as a demand
  miss of batch u (its bytes in demand-miss bytes) and reported as late bytes.

Lateness feeds back into nothing: d comes from the core's own hits and misses (a late
prefetch is priced as a hit there), which makes later prefetches slightly more likely to be
on time than in a machine that would stall; it is the cost model's estimate, not a profile.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from runtime.replay.cost_model import CostModel


@dataclass(frozen=True)
class PrefetchTiming:
    """Per phase (3,): late prefetches by the phase that used them."""

    late: np.ndarray             # (3,) int64 count
    late_bytes: np.ndarray       # (3,) int64
    late_rows: np.ndarray        # (n_rows,) bool: the rows of kind 4 that were late
    link_busy_s: float           # seconds the link carried prefetches
    compute_s: float             # the clock's end: sum of the batch times (0: not run, no
                                 # prefetch to time)


def batch_times(cost: CostModel, bounds: np.ndarray, layers: np.ndarray,
                multi_token: np.ndarray, experts: np.ndarray, miss_kind: np.ndarray,
                n_expert_used: int) -> tuple[np.ndarray, np.ndarray]:
    """(dense (n_batches,), total (n_batches,)) seconds of each batch on the cost model."""
    sizes = np.diff(bounds)
    n_b = len(sizes)
    batch_of = np.repeat(np.arange(n_b), sizes)
    missed = np.bincount(batch_of, weights=(miss_kind >= 1) & (miss_kind <= 2), minlength=n_b)
    b = cost.expert_bytes[layers]
    tokens = np.maximum(sizes // max(n_expert_used, 1), 1)
    tokens = np.where(multi_token, tokens, 1)
    dense = cost.gpu(cost.dense_bytes[layers], tokens.astype(np.float64))
    total = dense + (sizes - missed) * cost.gpu(b, 1.0) + missed * np.minimum(
        cost.fetch(b, 1.0), cost.cpu(b, 1.0))
    for i in np.flatnonzero(multi_token).tolist():   # prefill chunks: per key, by its tokens
        s, e = int(bounds[i]), int(bounds[i + 1])
        keys, inv, counts = np.unique(experts[s:e], return_inverse=True, return_counts=True)
        miss = np.zeros(len(keys), dtype=bool)
        kinds = miss_kind[s:e]
        miss[inv[(kinds >= 1) & (kinds <= 2)]] = True
        m = counts.astype(np.float64)
        bl = cost.expert_bytes[int(layers[i])]
        total[i] = dense[i] + float(cost.gpu(bl, m)[~miss].sum()) + float(
            np.minimum(cost.fetch(bl, m), cost.cpu(bl, m))[miss].sum())
    return dense, total


def fifo_finish(issue: np.ndarray, service: np.ndarray) -> np.ndarray:
    """Finish times of jobs served in order by one server: f[i] = max(f[i-1], issue[i]) +
    service[i] (issue non-decreasing), without a Python loop."""
    if len(issue) == 0:
        return np.zeros(0)
    c = np.cumsum(service)
    return c + np.maximum.accumulate(issue - (c - service))


def prefetch_timing(cost: CostModel, bounds: np.ndarray, layers: np.ndarray,
                    phases: np.ndarray, multi_token: np.ndarray, experts: np.ndarray,
                    outcome, n_expert: int, n_expert_used: int) -> PrefetchTiming:
    """Which first uses of prefetched experts (``outcome.miss_kind == 4``) came too late.
    ``outcome``: the manager's ReplayOutcome of the same batches."""
    kinds = outcome.miss_kind
    if len(outcome.prefetch_batch) == 0:              # nothing to time
        zero = np.zeros(3, dtype=np.int64)
        return PrefetchTiming(late=zero, late_bytes=zero.copy(),
                              late_rows=np.zeros(len(kinds), dtype=bool), link_busy_s=0.0,
                              compute_s=0.0)
    dense, total = batch_times(cost, bounds, layers, multi_token, experts, kinds, n_expert_used)
    start = np.concatenate([[0.0], np.cumsum(total)[:-1]])
    ready_at = start + dense                           # routing known / experts start
    sizes = np.diff(bounds)
    batch_of = np.repeat(np.arange(len(sizes)), sizes)
    pf_batch = outcome.prefetch_batch                  # issue order: batches non-decreasing
    pf_layer = outcome.prefetch_flat.astype(np.int64) // n_expert
    service = (cost.p.link_latency_us * 1e-6
               + cost.expert_bytes[pf_layer] / (cost.p.link_gbps * 1e9))
    pf_finish = fifo_finish(ready_at[pf_batch], service)   # (n_prefetches,)
    use_rows = np.flatnonzero(kinds == 4)
    late_rows = np.zeros(len(kinds), dtype=bool)
    late = np.zeros(3, dtype=np.int64)
    late_bytes = np.zeros(3, dtype=np.int64)
    if len(use_rows):
        ub = batch_of[use_rows]
        is_late = pf_finish[outcome.prefetch_event[use_rows]] > ready_at[ub]
        late_rows[use_rows[is_late]] = True
        lb = ub[is_late]
        ph = phases[lb].astype(np.int64)
        late = np.bincount(ph, minlength=3).astype(np.int64)
        late_bytes = np.bincount(ph, weights=cost.expert_bytes[layers[lb]],
                                 minlength=3).astype(np.int64)
    return PrefetchTiming(late=late, late_bytes=late_bytes, late_rows=late_rows,
                          link_busy_s=float(service.sum()), compute_s=float(total.sum()))
