"""Transports move expert bytes for the manager's decisions; the manager never holds its lock
while they do.

A decision takes effect at once (an admitted expert is resident from its admission on):
``drop(device, key)`` is called for each victim, then ``submit(ticket)`` for each expert to
move (a ``Ticket`` is a transfer notice). A move that fails calls
``manager.transfer_failed(ticket)``: the expert leaves the device. Transports: the
``SimulatedTransport`` (replay, tests: never called), the device cache
(runtime/native) and the RAM tier (runtime/ramtier).
"""
from __future__ import annotations

from typing import Protocol

from runtime.residency.types import ExpertKey, Ticket


class Transport(Protocol):
    def bind(self, manager) -> None: ...
    def submit(self, ticket: Ticket) -> None: ...
    def drop(self, device: str, key: ExpertKey) -> None: ...


class SimulatedTransport:
    """No bytes move (replay and tests): the manager does not even call it."""

    def bind(self, manager) -> None:
        self.manager = manager

    def submit(self, ticket: Ticket) -> None:
        return None

    def drop(self, device: str, key: ExpertKey) -> None:
        return None


# ---- one manager, several transports ---------------------------------------------------
# The engine builds the manager with its default (simulated) transport; tiers that move bytes
# (the RAM tier, the device cache) attach afterwards and claim their device.

class DeviceTransports:
    """Dispatch by ``ticket.device``; unclaimed devices use ``default``."""

    def __init__(self, default):
        self.default = default
        self.by_device: dict[str, object] = {}
        self.manager = None

    def claim(self, device: str, transport) -> None:
        """Serve ``device`` with ``transport`` (bound to the manager now if already bound)."""
        self.by_device[device] = transport
        if self.manager is not None:
            transport.bind(self.manager)

    def bind(self, manager) -> None:
        self.manager = manager
        self.default.bind(manager)
        for transport in self.by_device.values():
            transport.bind(manager)

    def transport_for(self, device: str):
        """The transport serving ``device``."""
        return self.by_device.get(device, self.default)

    def submit(self, ticket: Ticket) -> None:
        self.by_device.get(ticket.device, self.default).submit(ticket)

    def drop(self, device: str, key: ExpertKey) -> None:
        self.by_device.get(device, self.default).drop(device, key)


def claim_device(manager, device: str, transport) -> DeviceTransports:
    """Make ``transport`` serve ``device`` on ``manager`` (wrapping its transport once)."""
    mux = manager.transport
    if not isinstance(mux, DeviceTransports):
        mux = DeviceTransports(mux)
        mux.claim(device, transport)
        manager.set_transport(mux)
    else:
        mux.claim(device, transport)
        manager.refresh_transport()
    return mux
