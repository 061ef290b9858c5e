"""The Python feed from routing to the residency manager: the bookkeeping of a manager that
runs the Python reference core (the C hook steps a C core itself: rc_step), and of the
reference hook (reference.RoutingHook).

A thin adapter over the core's step: each route event is one ``manager.step`` per device
(lease this layer's experts, end the previous layer's lease) and a batch's end one
``manager.step_end`` (rc_step / rc_step_end, step.c: the rule lives there, not here). This
observer only does bookkeeping; a tier that moves bytes (the RAM tier, the device
cache) is its own consumer of the routing hook.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from runtime.residency.types import Phase

if TYPE_CHECKING:
    from runtime.engine.hook.events import RouteEvent


class ResidencyObserver:
    """Feeds ``manager`` with every route event, for each of ``devices``."""

    def __init__(self, manager, devices: Sequence[str]):
        self.manager = manager
        self.devices = tuple(devices)
        self._held = [0] * len(self.devices)    # each device's lease (core.step's), 0: none
        self.events = 0

    def on_route(self, event: RouteEvent) -> None:
        experts = event.experts.reshape(-1)   # (n_tokens * k,) routing order
        held, step = self._held, self.manager.step
        for i, device in enumerate(self.devices):
            previous, held[i] = held[i], 0    # ended by the step, refused or not
            held[i] = step(device, previous, event.layer, experts, event.phase).lease_id
        self.events += 1

    def on_batch_end(self, phase: Phase, n_tokens: int) -> None:
        held = self._held
        for i, device in enumerate(self.devices):
            previous, held[i] = held[i], 0
            self.manager.step_end(device, previous)
