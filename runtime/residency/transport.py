"""Transports move expert bytes for the manager's decisions; the manager never holds its lock
while they do.

A decision takes effect at once (an admitted expert is resident from its admission on):
``drop(device, key)`` is called for each victim, then ``submit(ticket)`` for each expert to
move (a ``Ticket`` is a transfer notice; ``TransferNotices`` builds them from a core call's
decisions and sends them). A move that fails calls
``manager.transfer_failed(ticket)``: the expert leaves the device. Transports: the
``SimulatedTransport`` (replay, tests: never called), the device cache
(runtime/native) and the RAM tier (runtime/ramtier).
"""
from __future__ import annotations

from typing import Protocol

from runtime.residency.types import ExpertKey, Phase, Ticket


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


class TransferNotices:
    """What a transport is told of a core call's decisions: a ``Ticket`` per admitted key and
    per prefetch, and the keys to drop (the evicted, the prefetches' victims). Mints the
    tickets' ids (one numbering per manager). ``of`` runs under the manager's lock, ``send``
    after it."""

    def __init__(self):
        self._next_id = 1

    def _ticket(self, device: str, key: ExpertKey, nbytes: int, victims: tuple, phase: Phase,
                prefetch: bool) -> Ticket:
        ticket = Ticket(self._next_id, device, key, nbytes, victims, phase, prefetch)
        self._next_id += 1
        return ticket

    def of(self, device: str, phase: Phase, admitted: tuple[ExpertKey, ...],
           evicted: tuple[ExpertKey, ...], prefetched, keys: list[ExpertKey], expert_bytes
           ) -> tuple[list[Ticket], list[ExpertKey]]:
        """(tickets, drops) in issue order: the admitted keys', then each prefetch's
        (``prefetched``: (flat key, victim flat keys) pairs; ``keys``: ExpertKey per flat
        key; ``expert_bytes``: per layer)."""
        submit = [self._ticket(device, key, int(expert_bytes[key.layer]), (), phase, False)
                  for key in admitted]
        drops = list(evicted)
        for flat, victims in prefetched:
            key = keys[flat]
            ticket = self._ticket(device, key, int(expert_bytes[key.layer]),
                                  tuple(keys[v] for v in victims), phase, True)
            drops.extend(ticket.victims)
            submit.append(ticket)
        return submit, drops

    @staticmethod
    def send(transport: Transport, device: str, submit: list[Ticket],
             drops: list[ExpertKey]) -> None:
        """Drops first (their space is free to reuse), then the transfers."""
        for key in drops:
            transport.drop(device, key)
        for ticket in submit:
            transport.submit(ticket)


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


def simulated(transport, device: str) -> bool:
    """Whether nothing moves on ``device``: ``transport`` (or, a mux, the one serving the
    device) is the simulated one."""
    pick = getattr(transport, "transport_for", None)
    return isinstance(pick(device) if pick is not None else transport, SimulatedTransport)


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
