"""Prefetch policies: after a layer's access, which experts to bring in ahead of demand.

``plan`` returns flat key indices (``layer * n_expert + expert``) in priority order; the
manager drops those already resident or in flight and issues tickets for the rest while it
can evict experts the eviction policy values less. Not consulted in MIXED batches.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from runtime.residency.stats import UsageStats
from runtime.residency.types import Phase, UpcomingStep


@dataclass(frozen=True, slots=True)
class PrefetchContext:
    """The access that just happened, and the model's MoE layer order."""

    phase: Phase
    layer: int
    experts: np.ndarray                  # (n,) expert ids of this access
    next_layers: tuple[int, ...]         # the MoE layers after ``layer``, ascending
    upcoming: UpcomingStep | None        # offline only


class NoPrefetch:
    name = "none"
    needs_uses = False
    needs_history = False

    def plan(self, ctx: PrefetchContext, stats: UsageStats) -> tuple[int, ...]:
        return ()


class ChunkPlan:
    """Prefill: pre-stage the next ``depth`` layers with the experts the previous chunk used.

    The chunk's own expert set for the current layer is already admitted as one batch by
    ``access_layer`` (the router has run for the whole chunk before the matmul).
    """

    name = "chunk-plan"
    needs_uses = False
    needs_history = True

    def __init__(self, depth: float = 1):
        self.depth = int(depth)

    def plan(self, ctx: PrefetchContext, stats: UsageStats) -> tuple[int, ...]:
        if ctx.phase != Phase.PREFILL:
            return ()
        history = stats.last_experts[Phase.PREFILL]
        out: list[int] = []
        for layer in ctx.next_layers[: self.depth]:
            previous = history.get(layer)
            if previous is not None:
                out.extend((layer * stats.n_expert + np.unique(previous)).tolist())
        return tuple(out)


class Popularity:
    """Keep the ``top_n`` most routed experts of the next layer resident (learned online)."""

    name = "popularity"
    needs_uses = True
    needs_history = False

    def __init__(self, top_n: float = 4):
        self.top_n = int(top_n)

    def plan(self, ctx: PrefetchContext, stats: UsageStats) -> tuple[int, ...]:
        if not ctx.next_layers or self.top_n <= 0:
            return ()
        layer = ctx.next_layers[0]
        n = stats.n_expert
        counts = stats.uses_np[:, layer * n:(layer + 1) * n].sum(axis=0)  # (n_expert,)
        top = min(self.top_n, n)
        # stable order: most used first, then lower expert id
        order = np.lexsort((np.arange(n), -counts))[:top]
        order = order[counts[order] > 0]
        return tuple((layer * n + order).tolist())


class BeladyPrefetch:
    """Offline: bring in the next layer-step's experts (read from the trace's future)."""

    name = "belady"
    needs_uses = False
    needs_history = False
    needs_upcoming = True

    def plan(self, ctx: PrefetchContext, stats: UsageStats) -> tuple[int, ...]:
        if ctx.upcoming is None:
            return ()
        up = ctx.upcoming
        keys = up.layer * stats.n_expert + np.asarray(up.experts, dtype=np.int64)
        return tuple(dict.fromkeys(keys.tolist()))
