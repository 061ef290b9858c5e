"""Eviction policies' Python references: each one pure ``priority`` (SGLang's get_priority) over
a core's statistics (``stats``: the ReferenceCore's last access, use counts and next uses), its
parameter block and its own state (lfu-decay's decayed counts, next-visit's model); the lowest
(priority, last access, key) is evicted first. The C core's twins are one file each,
runtime/residency/core/policies/evict_*.c (tests compare the two).
"""
from __future__ import annotations

import math

from runtime.residency.reference.next_visit import NextVisitModel


class EvictionPolicy:
    """One eviction order (the C twin's descriptor: rc_eviction_policy). ``params``: its C
    parameter block as CorePolicy.orders holds it; ``state``: its own (its create's, None
    without one). The hooks of its state, as the C twin's: ``create(core, params)``,
    ``visit`` (a layer-step's experts before any is touched, with the layer's resident
    mask), ``observe`` (the elements once touched, at sequence numbers seq0 + i),
    ``warm_start`` (a routing profile's key frequencies)."""

    planned_scores = False   # a planner's own scores (expected layer-steps) rank in it
    visit = observe = warm_start = None

    @staticmethod
    def create(core, params: tuple[float, ...]):
        return None

    @staticmethod
    def priority(stats, params: tuple[float, ...], state, f: int) -> float:
        raise NotImplementedError

    @classmethod
    def victim_order(cls, stats, order: int, keys: list[int]) -> list[int]:
        """``keys`` (evictable, resident) in eviction order: a heap's total order."""
        return sorted(keys, key=lambda f: stats.order_key(order, f))


class Lru(EvictionPolicy):
    @staticmethod
    def priority(stats, params, state, f):
        return float(stats.last[f])


class Lfu(EvictionPolicy):
    @staticmethod
    def priority(stats, params, state, f):
        u = stats.uses
        return float(u[0][f] + u[1][f] + u[2][f])


class LfuDecay(EvictionPolicy):
    """its state: (rate, each key's decayed count as a log); params: (ln 2 / half_life,)"""

    @staticmethod
    def create(core, params):
        return params[0], [-math.inf] * (core.n_layer * core.n_expert)

    @staticmethod
    def observe(state, layer, el, n_expert, seq0) -> None:
        rate, log = state
        for i, e in enumerate(el):
            f = layer * n_expert + e
            a, x = log[f], rate * (seq0 + i)
            hi, lo = (a, x) if a > x else (x, a)
            log[f] = hi + math.log1p(math.exp(lo - hi))

    @staticmethod
    def priority(stats, params, state, f):
        return state[1][f]


class PhaseWeighted(EvictionPolicy):
    @staticmethod
    def priority(stats, params, state, f):
        u = stats.uses
        return params[0] * float(u[0][f]) + params[1] * float(u[1][f] + u[2][f])


class Belady(EvictionPolicy):
    @staticmethod
    def priority(stats, params, state, f):
        return -float(stats.next_use[f])


class NextVisit(EvictionPolicy):
    """-(expected layer-steps to the next use); its order is its own index (nv_victim.h).
    Its state: its model (NextVisitModel); params: (learning_rate,)."""

    planned_scores = True

    @staticmethod
    def create(core, params):
        return NextVisitModel(core.n_layer, core.n_expert, core.moe_layers, params[0])

    @staticmethod
    def visit(model, layer, el, phase, resident) -> None:
        model.visit(layer, el, phase, resident)

    @staticmethod
    def warm_start(model, frequency) -> None:
        model.h = [list(frequency) for _ in model.h]

    @staticmethod
    def priority(stats, params, state, f):
        return -state.expected(f)

    @classmethod
    def victim_order(cls, stats, order, keys):
        # each layer's keys by (z, last seq, flat); the next victim is the layer head lowest
        # in (-expected, z, last seq, flat)
        nv, n_expert = stats.order_state[order], stats.n_expert
        by_layer: dict[int, list[int]] = {}
        for f in sorted(keys, key=lambda f: (nv.logit(f), stats.last[f], f)):
            by_layer.setdefault(f // n_expert, []).append(f)
        heads = {layer: 0 for layer in by_layer}
        out = []
        while heads:
            def head_key(layer: int) -> tuple:
                f = by_layer[layer][heads[layer]]
                return (cls.priority(stats, (), nv, f), nv.logit(f), stats.last[f], f)
            layer = min(heads, key=head_key)
            out.append(by_layer[layer][heads[layer]])
            heads[layer] += 1
            if heads[layer] == len(by_layer[layer]):
                del heads[layer]
        return out
