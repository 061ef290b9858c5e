"""The Python feed from routing to the residency manager: the bookkeeping of a manager that
runs the Python reference core (the C hook steps a C core itself: rc_step), and of the
reference hook (routing_hook.RoutingHook).

One ``access_layer`` per route event and device: the manager records the accesses per phase,
decides admissions and evictions, and leases the layer's experts. A layer's lease is released
when the next layer routes (in the same call: the graph runs layers in order, so its matmuls
are done) or when the batch ends: the rule of rc_step / rc_step_end (step.c). This observer
only does bookkeeping; a tier that moves bytes (the RAM tier, the device cache) is its
own consumer of the routing hook.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from runtime.residency.types import LayerAccess, Phase

if TYPE_CHECKING:                  # the reference hook (routing_hook.py) builds observers
    from runtime.engine.routing_hook import RouteEvent


class ResidencyObserver:
    """Feeds ``manager`` with every route event, for each of ``devices``."""

    def __init__(self, manager, devices: Sequence[str]):
        self.manager = manager
        self.devices = tuple(devices)
        self._held: list[LayerAccess] = []
        self.events = 0

    def on_route(self, event: RouteEvent) -> None:
        experts = event.experts.reshape(-1)   # (n_tokens * k,) routing order
        held = self._held
        self._held = [self.manager.access_layer(
            device, event.layer, experts, event.phase,
            release=held[i] if i < len(held) else None) for i, device in enumerate(self.devices)]
        self.events += 1

    def on_batch_end(self, phase: Phase, n_tokens: int) -> None:
        held, self._held = self._held, []
        for access in held:
            self.manager.release(access)
