"""Transports move expert bytes for the manager's decisions; the manager never holds its lock
while they do.

Two kinds (``inline``):
  * inline (``SimulatedTransport``, the native device cache, the RAM tier): the core decides
    at once (an admitted expert is resident from its admission on); ``drop(device, key)`` is
    called for each victim, then ``submit(ticket)`` for each expert to move. A move that fails
    calls ``manager.transfer_failed(ticket)``: the expert leaves the device.
  * ticket (``ThreadedTransport``, ``ManualTransport``): ``submit(ticket)`` must eventually call
    ``manager.commit(ticket)`` or ``manager.abort(ticket)`` (from any thread); the key is pending
    and its victims reserved meanwhile; ``drop`` is called for the victims after the commit.
"""
from __future__ import annotations

import queue
import threading
from typing import Callable, Protocol

from runtime.residency.types import ExpertKey, Ticket


class Transport(Protocol):
    inline: bool  # True: the manager commits tickets itself at once (nothing moves)

    def bind(self, manager) -> None: ...
    def submit(self, ticket: Ticket) -> None: ...
    def drop(self, device: str, key: ExpertKey) -> None: ...


class SimulatedTransport:
    """No bytes move (replay and tests): the manager does not even call it."""

    inline = True

    def bind(self, manager) -> None:
        self.manager = manager

    def submit(self, ticket: Ticket) -> None:
        return None

    def drop(self, device: str, key: ExpertKey) -> None:
        return None


class ThreadedTransport:
    """Runs ``copy(ticket)`` on ``workers`` threads (queue depth = workers, at least 4).

    A copy that raises aborts its ticket; otherwise the ticket commits. ``close()`` stops the
    workers after the queue drains.
    """

    inline = False

    def __init__(self, copy: Callable[[Ticket], None], *, workers: int = 4,
                 drop: Callable[[str, ExpertKey], None] | None = None):
        if workers < 4:
            raise ValueError("ThreadedTransport needs at least 4 workers (queue depth >= 4)")
        self._copy = copy
        self._drop = drop
        self._queue: queue.Queue[Ticket | None] = queue.Queue()
        self._threads = [threading.Thread(target=self._work, name=f"expert-copy-{i}", daemon=True)
                         for i in range(workers)]
        self.manager = None
        self.errors: list[BaseException] = []

    def bind(self, manager) -> None:
        self.manager = manager
        for t in self._threads:
            if not t.is_alive():
                t.start()

    def submit(self, ticket: Ticket) -> None:
        self._queue.put(ticket)

    def drop(self, device: str, key: ExpertKey) -> None:
        if self._drop is not None:
            self._drop(device, key)

    def _work(self) -> None:
        while True:
            ticket = self._queue.get()
            if ticket is None:
                return
            try:
                self._copy(ticket)
            except BaseException as err:  # a failed copy must not leave the ticket pending
                self.errors.append(err)
                self.manager.abort(ticket)
            else:
                self.manager.commit(ticket)

    def close(self) -> None:
        for _ in self._threads:
            self._queue.put(None)
        for t in self._threads:
            if t.is_alive():
                t.join()


class ManualTransport:
    """A fake that holds tickets until someone calls ``commit_next``/``abort_next`` (tests,
    step-by-step tools). Nothing moves."""

    inline = False

    def __init__(self) -> None:
        self.pending: list[Ticket] = []
        self.dropped: list[tuple[str, ExpertKey]] = []
        self.manager = None

    def bind(self, manager) -> None:
        self.manager = manager

    def submit(self, ticket: Ticket) -> None:
        self.pending.append(ticket)

    def drop(self, device: str, key: ExpertKey) -> None:
        self.dropped.append((device, key))

    def commit_next(self, index: int = 0) -> Ticket:
        ticket = self.pending.pop(index)
        self.manager.commit(ticket)
        return ticket

    def abort_next(self, index: int = 0) -> Ticket:
        ticket = self.pending.pop(index)
        self.manager.abort(ticket)
        return ticket

    def commit_all(self) -> None:
        while self.pending:
            self.commit_next()


# ---- one manager, several transports ---------------------------------------------------
# The engine builds the manager with its default (simulated) transport; tiers that move bytes
# (the RAM tier, the native device cache) attach afterwards and claim their device. Whether a
# device's decisions are inline is its own transport's (``transport_for(device).inline``).

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
