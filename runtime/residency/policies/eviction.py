"""Eviction policies' Python references: each one pure ``priority`` (SGLang's get_priority) over
a core's statistics (``stats``: the ReferenceCore's last access, use counts, decayed counts,
next uses and next-visit model); the lowest (priority, last access, key) is evicted first. The
C core's twins are one file each, runtime/residency/core/policies/evict_*.c (tests compare the
two).
"""
from __future__ import annotations


class EvictionPolicy:
    """One eviction order. ``params``: its (p1, p2) as CorePolicy.orders holds them."""

    planned_scores = False   # a planner's own scores (expected layer-steps) rank in it

    @staticmethod
    def create(core) -> None:
        """its own model (the C twin's order create hook), if any"""

    @staticmethod
    def priority(stats, params: tuple[float, float], f: int) -> float:
        raise NotImplementedError

    @classmethod
    def victim_order(cls, stats, order: int, keys: list[int]) -> list[int]:
        """``keys`` (evictable, resident) in eviction order: a heap's total order."""
        return sorted(keys, key=lambda f: stats.order_key(order, f))


class Lru(EvictionPolicy):
    @staticmethod
    def priority(stats, params, f):
        return float(stats.last[f])


class Lfu(EvictionPolicy):
    @staticmethod
    def priority(stats, params, f):
        u = stats.uses
        return float(u[0][f] + u[1][f] + u[2][f])


class LfuDecay(EvictionPolicy):
    @staticmethod
    def priority(stats, params, f):
        return stats.decay[f]


class PhaseWeighted(EvictionPolicy):
    @staticmethod
    def priority(stats, params, f):
        u = stats.uses
        return params[0] * float(u[0][f]) + params[1] * float(u[1][f] + u[2][f])


class Belady(EvictionPolicy):
    @staticmethod
    def priority(stats, params, f):
        return -float(stats.next_use[f])


class NextVisit(EvictionPolicy):
    """-(expected layer-steps to the next use); its order is its own index (nv_victim.h)."""

    planned_scores = True

    @staticmethod
    def create(core) -> None:
        core.nv = core.next_visit_model()

    @staticmethod
    def priority(stats, params, f):
        return -stats.nv.expected(f)

    @classmethod
    def victim_order(cls, stats, order, keys):
        # each layer's keys by (z, last seq, flat); the next victim is the layer head lowest
        # in (-expected, z, last seq, flat)
        nv, n_expert = stats.nv, stats.n_expert
        by_layer: dict[int, list[int]] = {}
        for f in sorted(keys, key=lambda f: (nv.logit(f), stats.last[f], f)):
            by_layer.setdefault(f // n_expert, []).append(f)
        heads = {layer: 0 for layer in by_layer}
        out = []
        while heads:
            def head_key(layer: int) -> tuple:
                f = by_layer[layer][heads[layer]]
                return (cls.priority(stats, (), f), nv.logit(f), stats.last[f], f)
            layer = min(heads, key=head_key)
            out.append(by_layer[layer][heads[layer]])
            heads[layer] += 1
            if heads[layer] == len(by_layer[layer]):
                del heads[layer]
        return out
