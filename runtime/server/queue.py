"""A bounded FIFO of blocking jobs served one at a time by a single worker thread.

The engine is blocking and holds one model, so requests run one after another in arrival order.
A job is a function ``work(cancel) -> Iterable[item]`` run on the worker thread; its items reach
the event loop through an ``asyncio.Queue`` (``loop.call_soon_threadsafe``), so a handler
consumes them with ``async for``. Setting a job's cancel event (the client went away) makes the
worker stop pulling items from it — and the engine, which gets the same event, stops generating
— so the next job starts at once. A job cancelled while still waiting never runs.

Bound: at most ``max_waiting`` jobs wait behind the running one; ``submit`` raises
``QueueFull`` beyond that (the server answers 429). A waiting job whose cancel event is set
(its client went away) leaves the queue at once: it holds no place against that bound and is
not counted as waiting (invariant: every job in ``_waiting`` has its cancel event clear, as
far as the last ``_drop_cancelled`` saw).

A request that must be prepared before its job exists (a schema turned into a grammar takes
seconds) takes its place first: ``reserve()`` counts it as waiting (or raises ``QueueFull``
at once, before any work), and ``submit(work, reservation)`` turns the place into the job.
So 40 such requests at once cost the preparation of those that fit, not of all 40.
"""
from __future__ import annotations

import asyncio
import collections
import logging
import threading
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass
from typing import Any

log = logging.getLogger("moe_offload.server")

Work = Callable[[threading.Event], Iterable[Any]]


class QueueFull(Exception):
    """The queue already holds ``max_waiting`` waiting jobs."""


class QueueClosed(Exception):
    """The queue takes no more jobs: the server is stopping."""


@dataclass(frozen=True, slots=True)
class QueueStats:
    running: int        # 0 or 1
    waiting: int        # jobs submitted and not yet started
    max_waiting: int


class Reservation:
    """A place in the queue taken before the job exists (``RequestQueue.reserve``); used by
    ``submit`` or given back by ``release`` (both once: a second call does nothing)."""

    __slots__ = ("_queue", "_held")

    def __init__(self, queue: RequestQueue) -> None:
        self._queue, self._held = queue, True

    def release(self) -> None:
        self._queue._give_back(self)

    def __enter__(self) -> Reservation:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.release()


class _End:
    """Marks the end of a job's items; carries the exception that ended it, if any."""

    __slots__ = ("error",)

    def __init__(self, error: BaseException | None) -> None:
        self.error = error


class Job:
    """One submitted unit of work, consumed on the event loop with ``async for``."""

    def __init__(self, work: Work, loop: asyncio.AbstractEventLoop) -> None:
        self.work = work
        self.cancel = threading.Event()
        self._loop = loop
        self._items: asyncio.Queue[Any] = asyncio.Queue()
        self._done = False

    # -- worker side (called on the worker thread) --------------------------------------------
    def _deliver(self, item: Any) -> None:
        try:
            self._loop.call_soon_threadsafe(self._items.put_nowait, item)
        except RuntimeError:        # the event loop is closed: nobody is listening any more
            self.cancel.set()

    # -- consumer side (event loop) -----------------------------------------------------------
    def __aiter__(self) -> AsyncIterator[Any]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[Any]:
        try:
            while not self._done:
                item = await self._items.get()
                if isinstance(item, _End):
                    self._done = True
                    if item.error is not None:
                        raise item.error
                    return
                yield item
        finally:
            if not self._done:      # the consumer stopped early (disconnect, error, cancel)
                self.cancel.set()


class RequestQueue:
    """FIFO of jobs with one worker thread. Create and submit from the event loop thread."""

    def __init__(self, max_waiting: int, *, name: str = "moe-offload-worker",
                 workers: int = 1) -> None:
        """``workers``: jobs run at once (the engine's batch slots; 1 = strictly in turn)."""
        if max_waiting < 0:
            raise ValueError("max_waiting must be >= 0")
        if workers < 1:
            raise ValueError("workers must be >= 1")
        self.max_waiting = max_waiting
        self.workers = workers
        self._lock = threading.Lock()
        self._ready = threading.Condition(self._lock)
        self._waiting: collections.deque[Job] = collections.deque()
        self._running: set[Job] = set()
        self._reserved = 0                 # places taken by requests still being prepared
        self._closed = False
        self._threads = [threading.Thread(target=self._serve, name=f"{name}-{i}", daemon=True)
                         for i in range(workers)]
        for thread in self._threads:
            thread.start()

    def stats(self) -> QueueStats:
        with self._lock:
            self._drop_cancelled()
            return QueueStats(running=len(self._running),
                              waiting=len(self._waiting) + self._reserved,
                              max_waiting=self.max_waiting)

    def reserve(self) -> Reservation:
        """Take a place for a job to be submitted later; raises ``QueueFull`` (or
        ``QueueClosed``) as ``submit`` would."""
        with self._lock:
            self._check_room()
            self._reserved += 1
        return Reservation(self)

    def submit(self, work: Work, reservation: Reservation | None = None) -> Job:
        """Queue ``work`` (in the place ``reservation`` holds, if given); raises
        ``QueueFull`` when ``max_waiting`` jobs are already waiting.

        A job that arrives while nothing runs starts at once and never counts as waiting.
        """
        job = Job(work, asyncio.get_running_loop())
        with self._lock:
            if reservation is not None and reservation._held:
                reservation._held = False
                self._reserved -= 1
                if self._closed:
                    raise QueueClosed("the server is shutting down")
            else:
                self._check_room()
            self._waiting.append(job)
            self._ready.notify()
        return job

    def _check_room(self) -> None:
        """Raise unless one more job may wait (lock held)."""
        if self._closed:
            raise QueueClosed("the server is shutting down")
        self._drop_cancelled()
        if not self._has_room():
            raise QueueFull(f"queue full: {len(self._waiting) + self._reserved} waiting")

    def _give_back(self, reservation: Reservation) -> None:
        with self._lock:
            if reservation._held:
                reservation._held = False
                self._reserved -= 1

    def cancel_all(self) -> None:
        """Refuse new jobs and cancel every job, waiting or running; does not block."""
        with self._lock:
            self._closed = True
            jobs = list(self._waiting) + list(self._running)
            self._ready.notify_all()
        for job in jobs:
            job.cancel.set()

    def close(self, timeout: float | None = 5.0) -> None:
        """``cancel_all()``, then wait up to ``timeout`` seconds for the worker to stop."""
        self.cancel_all()
        for thread in self._threads:
            thread.join(timeout)

    def _drop_cancelled(self) -> None:
        """Take waiting jobs whose client left out of the queue (lock held); each gets its
        end, so a consumer still listening (a shutdown's cancel) finishes."""
        if not any(job.cancel.is_set() for job in self._waiting):
            return
        kept: collections.deque[Job] = collections.deque()
        for job in self._waiting:
            if job.cancel.is_set():
                job._deliver(_End(None))
            else:
                kept.append(job)
        self._waiting = kept

    def _has_room(self) -> bool:
        # Jobs that idle workers are about to take are not really waiting (a worker may not
        # have woken up yet): only those beyond the idle workers count.
        idle = self.workers - len(self._running)
        pending = len(self._waiting) + self._reserved
        waiting = max(0, pending - idle)
        return waiting < self.max_waiting or pending < idle

    def _next(self) -> Job | None:
        with self._lock:
            while True:
                self._drop_cancelled()
                if self._waiting or self._closed:
                    break
                self._ready.wait()
            if self._closed:
                for job in self._waiting:
                    job._deliver(_End(None))
                self._waiting.clear()
                return None
            job = self._waiting.popleft()
            self._running.add(job)
            return job

    def _serve(self) -> None:
        while (job := self._next()) is not None:
            error: BaseException | None = None
            try:
                if not job.cancel.is_set():
                    self._run(job)
            except BaseException as exc:  # noqa: BLE001 - forwarded to the request, never lost
                error = exc
            finally:
                with self._lock:
                    self._running.discard(job)
                job._deliver(_End(error))

    @staticmethod
    def _run(job: Job) -> None:
        items = job.work(job.cancel)
        try:
            for item in items:
                job._deliver(item)
                if job.cancel.is_set():
                    break
        finally:
            close = getattr(items, "close", None)
            if close is not None:   # a generator: run its cleanup now, on this thread
                close()
