"""Static residency: whole layers' experts pinned on a device that nothing can move to.

Without a native device cache, experts reach a GPU only at load time (tensor overrides), so
the manager decides which layers' experts live there and pins them: ``plan_static`` (pure)
picks them, ``pin_static`` makes them resident for good and marks the device static. On a
static device an access to a pinned expert is a hit; any other is a demand miss used
transiently (counted in ``transient_uses``), never admitted, and nothing is evicted or
prefetched. A mixin of ``ExpertResidencyManager`` (manager.py owns the state it uses).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from runtime.errors import UserError
from runtime.residency.device_state import RESIDENT_MAX, DeviceState
from runtime.residency.types import LayerAccess, Phase

_EMPTY: tuple = ()


@dataclass(frozen=True)
class StaticPlan:
    """Which layers' experts stay on ``device`` for good (all ``n_expert`` of each layer)."""

    device: str
    layers: tuple[int, ...]   # MoE layers, ascending: one contiguous run from the first
    keys: int                 # experts pinned: len(layers) * n_expert
    bytes: int                # bytes those experts take


def first_fitting_layers(expert_bytes: Sequence[int], n_expert: int,
                         capacity_bytes: int) -> tuple[tuple[int, ...], int]:
    """The first MoE layers (expert bytes > 0) whose whole expert sets fit ``capacity_bytes``
    together, in order, stopping at the first that does not fit; and the bytes they take.

    expert_bytes: (n_layer,) bytes of one expert per layer (0: dense layer)."""
    chosen, used = [], 0
    for layer, one in enumerate(expert_bytes):
        if one <= 0:
            continue
        size = int(one) * n_expert
        if used + size > capacity_bytes:
            break
        chosen.append(layer)
        used += size
    return tuple(chosen), used


class StaticMixin:
    def plan_static(self, device: str) -> StaticPlan:
        """The static plan for ``device`` at its resolved capacity (changes nothing).
        UserError before bind_model / resolve_device or for an unknown device."""
        with self._lock:
            st = self._devices.get(device)
            if st is None:
                self._unknown_device(device)
            if st.capacity is None:
                raise UserError(f"{device}: plan_static needs a resolved capacity "
                                "(resolve_device)")
            layers, used = first_fitting_layers(self._expert_bytes.tolist(), self._n_expert,
                                                st.capacity)
        return StaticPlan(device, layers, len(layers) * self._n_expert, used)

    def pin_static(self, device: str, plan: StaticPlan) -> None:
        """Make ``plan``'s experts resident on ``device`` for good and mark it static.

        Refused (UserError) unless the plan is for this device, names MoE layers within its
        capacity, and the device holds nothing yet (no resident experts, tickets or leases)."""
        with self._lock:
            st = self._devices.get(device)
            if st is None:
                self._unknown_device(device)
            ne = self._n_expert
            moe = [i for i, b in enumerate(self._moe_layer) if b]
            problem = None
            if plan.device != device:
                problem = f"the plan is for {plan.device!r}"
            elif st.static:
                problem = "it is static already"
            elif st.capacity is None:
                problem = "its capacity is not resolved (resolve_device)"
            elif st.resident_count or st.tickets or st.leases:
                problem = "it already holds experts, transfers or leases"
            elif not set(plan.layers) <= set(moe) or len(set(plan.layers)) != len(plan.layers):
                problem = f"plan layers {plan.layers} are not distinct MoE layers"
            elif plan.keys != len(plan.layers) * ne or plan.bytes != sum(
                    int(self._expert_bytes[i]) * ne for i in plan.layers):
                problem = "the plan's key count or bytes disagree with the model"
            elif plan.bytes > st.capacity:
                problem = f"the plan's {plan.bytes} bytes exceed the capacity {st.capacity}"
            if problem is not None:
                raise UserError(f"{device}: cannot pin statically: {problem}")
            for layer in plan.layers:
                base = layer * ne
                for flat in range(base, base + ne):
                    st.make_resident(flat, int(Phase.DECODE), False)
            st.static = True
            st.static_bytes = plan.bytes
            self._refresh_fast(st)
            st.verify()
            assert st.resident_bytes == plan.bytes and st.resident_count == plan.keys

    def is_static(self, device: str) -> bool:
        """True once ``pin_static`` ran on ``device``."""
        st = self._devices.get(device)
        return st is not None and st.static

    def _access_static(self, st: DeviceState, device: str, layer: int, el: list[int],
                       phase: Phase, lease: bool) -> LayerAccess:
        """access_layer on a static device: pinned experts hit; the rest are transient."""
        with self._lock:
            base = self._base_of(layer)
            self._check_experts(el)           # before anything changes
            n = len(el)
            self._seq += n
            state, keys = st.state, st.keys
            missed = [keys[base + e] for e in dict.fromkeys(el)
                      if state[base + e] > RESIDENT_MAX]
            lease_id = self._take_lease(st, base, el, lease)
            m = len(missed)
            mb = m * st.bytes_flat[base]
            tally = st.tally[phase]
            tally.accesses += n
            if m:
                tally.misses += m
                tally.demand_miss_bytes += mb
                tally.transient_uses += m
                tally.transient_bytes += mb
            return LayerAccess(device, layer, phase, n - m, m, mb, _EMPTY, _EMPTY,
                               tuple(missed), _EMPTY, 0, lease_id)
