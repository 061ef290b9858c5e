"""Static residency: whole layers' experts pinned on a device that nothing can move to.

Without a native device cache, experts reach a GPU only at load time (tensor overrides), so
the manager decides which layers' experts live there and pins them: ``plan_static`` (pure)
picks them, ``pin_static`` makes them resident for good and marks the device static. On a
static device an access to a pinned expert is a hit; any other is a demand miss used
transiently (counted in ``transient_uses``), never admitted, and nothing is evicted or
prefetched (the residency core's static mode). ``plan``/``pin`` serve the manager's
``plan_static``/``pin_static``.
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


def plan(manager, device: str, skip: Sequence[int] = ()) -> StaticPlan:
    """The static plan for ``device`` at its resolved capacity (changes nothing); ``skip``:
    layers that stay off it (``first_fitting_layers``).
    UserError before bind_model / resolve_device or for an unknown device."""
    with manager._lock:
        manager._device(device)
    capacity = manager.capacity(device)
    if capacity is None:
        raise UserError(f"{device}: plan_static needs a resolved capacity (resolve_device)")
    layers, used = first_fitting_layers(manager._expert_bytes.tolist(), manager.n_expert,
                                        capacity, skip)
    return StaticPlan(device, layers, len(layers) * manager.n_expert, used)


def pin(manager, device: str, plan: StaticPlan) -> None:
    """Make ``plan``'s experts resident on ``device`` for good and mark it static.

    Refused (UserError) unless the plan is for this device, names MoE layers within its
    capacity, and the device holds nothing yet (no resident experts, tickets or leases)."""
    capacity = manager.capacity(device)
    with manager._lock:
        dev = manager._device(device)
        ne = manager.n_expert
        eb = manager._expert_bytes
        moe = [i for i, b in enumerate(eb.tolist()) if b]
        stats = [dev.core.pool_stats(i) for i in range(len(dev.pools))]
        problem = None
        if plan.device != device:
            problem = f"the plan is for {plan.device!r}"
        elif dev.static:
            problem = "it is static already"
        elif capacity is None:
            problem = "its capacity is not resolved (resolve_device)"
        elif any(s[2] or s[4] for s in stats) or dev.core.n_leases:
            problem = "it already holds experts, transfers or leases"
        elif not set(plan.layers) <= set(moe) or len(set(plan.layers)) != len(plan.layers):
            problem = f"plan layers {plan.layers} are not distinct MoE layers"
        elif plan.keys != len(plan.layers) * ne or plan.bytes != sum(
                int(eb[i]) * ne for i in plan.layers):
            problem = "the plan's key count or bytes disagree with the model"
        elif plan.bytes > capacity:
            problem = f"the plan's {plan.bytes} bytes exceed the capacity {capacity}"
        if problem is not None:
            raise UserError(f"{device}: cannot pin statically: {problem}")
        flats = [layer * ne + e for layer in plan.layers for e in range(ne)]
        if dev.core.pin_static(flats) != 0:
            raise UserError(f"{device}: cannot pin statically: the core refused the plan")
        dev.static = True
        dev.static_bytes = plan.bytes
        assert sum(dev.core.pool_stats(i)[1] for i in range(len(dev.pools))) == plan.bytes
