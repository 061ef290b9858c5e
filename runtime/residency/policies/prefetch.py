"""Prefetch planners' Python references: each one ``plan`` (the keys to bring in after a
layer-step, priority order, and optionally their own priorities) from what the step left
(``PlanStep``) and the core's statistics; ``after`` (optional) sees what was brought in. The
C twins: one file each, runtime/residency/core/policies/prefetch_*.c."""
from __future__ import annotations

from dataclasses import dataclass

from runtime.residency.reference.affinity import AffinityModel

ABSENT = 8   # the core's key state of an absent key (runtime.residency.core.ABSENT)


@dataclass(frozen=True, slots=True)
class PlanStep:
    """The layer-step a planner plans after."""

    layer: int
    phase: int
    params: tuple[float, ...]   # the planner's parameter block (CorePolicy.prefetch)
    state: object            # its own state (its create's), shared by the phases naming it
    upcoming: tuple | None   # (layer, experts, index) of the next step (offline), or None
    n_hits: int
    n_misses: int
    next_layers: tuple[int, ...]   # the MoE layers after ``layer``, ascending


class Planner:
    """One planner (the C twin's descriptor: rc_prefetch_policy). ``needs_history``: the core
    keeps each (phase, layer)'s latest experts for it. Its own state (the C twin's hooks):
    ``create(core, params)`` makes it (None: none), ``observe`` sees every layer-step before
    any key is touched, ``warm_start`` a routing profile's pairs and history."""

    needs_history = False
    observe = warm_start = None

    @staticmethod
    def plan(core, step: PlanStep):
        raise NotImplementedError

    @staticmethod
    def create(core, params: tuple[float, ...]):
        return None


class NoPrefetch(Planner):
    """none: no plan (its C twin's plan is NULL)"""

    plan = None


class ChunkPlan(Planner):
    """prefill: the next ``depth`` MoE layers' experts of the previous chunk (sorted, distinct)."""

    needs_history = True

    @staticmethod
    def plan(core, step):
        if step.phase != 0:
            return [], None
        ne, out = core.n_expert, []
        for layer in step.next_layers[:int(step.params[0])]:     # depth
            prev = core.history.get((0, layer))
            if prev is not None:
                out.extend(layer * ne + e for e in sorted(set(prev)))
        return out, None


class Popularity(Planner):
    """the next MoE layer's ``top_n`` most routed experts (then lower id; used at all)."""

    @staticmethod
    def plan(core, step):
        top_n = int(step.params[0])
        if not step.next_layers or top_n <= 0:
            return [], None
        ne, layer, u = core.n_expert, step.next_layers[0], core.uses
        counts = [u[0][layer * ne + e] + u[1][layer * ne + e] + u[2][layer * ne + e]
                  for e in range(ne)]
        ranked = sorted(range(ne), key=lambda e: (-counts[e], e))[:min(top_n, ne)]
        return [layer * ne + e for e in ranked if counts[e] > 0], None


class BeladyPrefetch(Planner):
    """offline: the next layer-step's distinct experts."""

    @staticmethod
    def plan(core, step):
        if step.upcoming is None:
            return [], None
        layer, experts, _ = step.upcoming
        return list(dict.fromkeys(int(layer) * core.n_expert + int(e) for e in experts)), None


class Affinity(Planner):
    """decode: affinity's plan (reference/affinity.py), each key ranked by its predicted
    expected time; what it planned but did not bring in goes back to its link budget."""

    @staticmethod
    def create(core, params):
        """its model, from its block: top_n, min_precision, link bytes per layer-step, the
        [cost] rates (factory._affinity_block)"""
        model = AffinityModel(core.n_layer, core.n_expert, core.moe_layers, *params[:3],
                              float(max(core.nbytes)), params[3:7], core.policy.n_expert_used)
        model.bytes_of = lambda f: core.nbytes[f]
        return model

    @staticmethod
    def observe(model, layer, el, phase) -> None:
        model.observe(layer, el, phase)

    @staticmethod
    def warm_start(model, pair, count, history) -> None:
        if pair.size:
            model.warm_start(pair, count)
        if model.nb is not None and history is not None and history.size:
            model.nb.warm_start(history.tolist())

    @staticmethod
    def plan(core, step):
        if step.phase != 1:
            return [], None
        model = step.state
        got = model.plan(step.layer, step.n_hits, step.n_misses,
                         lambda f: core.state[f] == ABSENT)
        n_moe = float(len(core.moe_layers))
        mine = [-(float(model.plan_lead) + n_moe * (1.0 / q - 1.0)) for _, q in got]
        return [f for f, _ in got], mine

    @staticmethod
    def after(core, model, plan: list[int], brought: list[int]) -> None:
        spent = 0.0                               # every planned key is absent
        for f in plan:
            spent = spent + model.transfer_cost(core.nbytes[f])
        for f in brought:
            spent = spent - model.transfer_cost(core.nbytes[f])
        model.refund(spent)
