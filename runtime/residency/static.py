"""Static residency: whole layers' experts pinned on a device that nothing can move to.

Without a device cache, experts reach a GPU only at load time (tensor overrides), so
the manager decides which layers' experts live there and pins them: ``plan_static`` (pure)
picks them, ``pin_static`` makes them resident for good and marks the device static. On a
static device an access to a pinned expert is a hit; any other is a demand miss used
transiently (counted in ``transient_uses``), never admitted, and nothing is evicted or
prefetched (the residency core's static mode). The manager's ``plan_static``/``pin_static``
take the rules here (``plan``, ``first_fitting_layers``, ``plan_problem``, ``pin``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from runtime.errors import UserError



@dataclass(frozen=True)
class StaticPlan:
    """Which layers' experts stay on ``device`` for good (all ``n_expert`` of each layer)."""

    device: str
    layers: tuple[int, ...]   # MoE layers, ascending: one contiguous run from the first not
    #                           skipped (first_fitting_layers)
    keys: int                 # experts pinned: len(layers) * n_expert
    bytes: int                # bytes those experts take


def first_fitting_layers(expert_bytes: Sequence[int], n_expert: int,
                         capacity_bytes: int, skip: Sequence[int] = ()
                         ) -> tuple[tuple[int, ...], int]:
    """The first MoE layers (expert bytes > 0) whose whole expert sets fit ``capacity_bytes``
    together, in order, stopping at the first that does not fit; and the bytes they take.
    ``skip``: layers passed over (their experts are kept on the CPU by a static rule, e.g.
    ``--n-cpu-moe``).

    expert_bytes: (n_layer,) bytes of one expert per layer (0: dense layer)."""
    chosen, used = [], 0
    for layer, one in enumerate(expert_bytes):
        if one <= 0 or layer in skip:
            continue
        size = int(one) * n_expert
        if used + size > capacity_bytes:
            break
        chosen.append(layer)
        used += size
    return tuple(chosen), used


def plan(device: str, expert_bytes: Sequence[int], n_expert: int, capacity_bytes: int,
         skip: Sequence[int] = ()) -> StaticPlan:
    """The static plan for ``device``: its ``first_fitting_layers``, whole."""
    layers, used = first_fitting_layers(expert_bytes, n_expert, capacity_bytes, skip)
    return StaticPlan(device, layers, len(layers) * n_expert, used)


def plan_problem(plan: StaticPlan, device: str, *, capacity: int | None,
                 expert_bytes: Sequence[int], n_expert: int, is_static: bool,
                 holds_anything: bool) -> str | None:
    """Why ``plan`` cannot be pinned on ``device`` as it stands, or None (pure: the manager
    passes its device's facts). Pinnable: the plan is for this device, names distinct MoE
    layers within its resolved capacity with their real key count and bytes, and the device
    is not static yet and holds nothing (no resident expert or lease)."""
    moe = [i for i, b in enumerate(expert_bytes) if b]
    if plan.device != device:
        return f"the plan is for {plan.device!r}"
    if is_static:
        return "it is static already"
    if capacity is None:
        return "its capacity is not resolved (resolve_device)"
    if holds_anything:
        return "it already holds experts or leases"
    if not set(plan.layers) <= set(moe) or len(set(plan.layers)) != len(plan.layers):
        return f"plan layers {plan.layers} are not distinct MoE layers"
    if plan.keys != len(plan.layers) * n_expert or plan.bytes != sum(
            int(expert_bytes[i]) * n_expert for i in plan.layers):
        return "the plan's key count or bytes disagree with the model"
    if plan.bytes > capacity:
        return f"the plan's {plan.bytes} bytes exceed the capacity {capacity}"
    return None


def pin(device, plan: StaticPlan, capacity: int | None, expert_bytes: Sequence[int],
        n_expert: int) -> None:
    """Pin ``plan`` on ``device`` (a residency.device.Device, under its manager's lock) and
    mark it static; UserError as ``plan_problem`` says."""
    stats = [device.core.pool_stats(i) for i in range(len(device.pools))]
    problem = plan_problem(plan, device.name, capacity=capacity, expert_bytes=expert_bytes,
                           n_expert=n_expert, is_static=device.static,
                           holds_anything=any(s.resident_count for s in stats)
                           or bool(device.core.n_leases))
    if problem is not None:
        raise UserError(f"{device.name}: cannot pin statically: {problem}")
    flats = [layer * n_expert + e for layer in plan.layers for e in range(n_expert)]
    if device.core.pin_static(flats) != 0:
        raise UserError(f"{device.name}: cannot pin statically: the core refused the plan")
    device.static = True
    device.static_bytes = plan.bytes
    assert sum(device.core.pool_stats(i).resident_bytes
               for i in range(len(device.pools))) == plan.bytes
