"""Work a request asks for beside generation: tokenizing, detokenizing, rendering a chat
template, turning a JSON schema into a grammar (a 20k-item enum takes seconds of Python).

It runs off the event loop, so ``/health`` and the streams in flight go on, and off the
generation queue's workers, on at most ``threads`` threads at once (``--threads-http``, as
llama-server's flag); at most ``max_waiting`` requests wait for one (``--queue-size``), and
beyond that ``run`` raises ``QueueFull`` (the server answers 429) before any work. A request
that already holds a place in the generation queue (``queue.Reservation``) waits without a
bound: that place is its bound.

Before this, such work ran on anyio's shared pool of 40 threads with no bound: 40 schema
conversions at once held the interpreter (``/health`` took 19 s), and a request that filled the
pool starved every other route that needs a thread.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import anyio

from runtime.server.queue import QueueFull

T = TypeVar("T")


class SideWork:
    """A bounded pool for side work; create it on the event loop (anyio's limiter needs one)."""

    def __init__(self, threads: int, max_waiting: int) -> None:
        if threads < 1:
            raise ValueError("threads must be >= 1")
        if max_waiting < 0:
            raise ValueError("max_waiting must be >= 0")
        self.max_waiting = max_waiting
        self._limiter = anyio.CapacityLimiter(threads)

    def can_start(self) -> bool:
        """A thread is free, or fewer than ``max_waiting`` requests wait for one."""
        stats = self._limiter.statistics()
        return stats.borrowed_tokens < stats.total_tokens or \
            stats.tasks_waiting < self.max_waiting

    def to_prometheus(self) -> str:
        """Gauges of the pool for ``/metrics``: jobs running, requests waiting."""
        stats = self._limiter.statistics()
        return "".join(
            f"# HELP moe_server_side_work_{name} {text}\n"
            f"# TYPE moe_server_side_work_{name} gauge\nmoe_server_side_work_{name} {value}\n"
            for name, text, value in (
                ("running", "Side work (tokenize, templates, schema preparation) running now.",
                 stats.borrowed_tokens),
                ("waiting", "Requests waiting for a side thread.", stats.tasks_waiting)))

    async def run(self, work: Callable[[], T], *, queued: bool = False) -> T:
        """``work()`` on a side thread, once one is free; ``QueueFull`` when none is and the
        waiting places are taken (unless ``queued``: the request holds a queue place)."""
        if not queued and not self.can_start():
            raise QueueFull(f"every side thread is busy and {self.max_waiting} requests wait "
                            "for one")
        return await anyio.to_thread.run_sync(work, limiter=self._limiter)
