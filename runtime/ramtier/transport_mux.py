"""One manager, several transports: tickets and drops go to the transport of their device.

The engine builds the manager with its default (simulated) transport; tiers that move bytes
attach afterwards and claim their device. Whether a device's decisions are inline (resident
from admission on) is its own transport's (``transport_for(device).inline``).
"""
from __future__ import annotations

from runtime.residency.types import ExpertKey, Ticket


class DeviceTransports:
    """Dispatch by ``ticket.device``; unclaimed devices use ``default``."""

    inline = False   # per device: transport_for(device).inline

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
