"""One model app's lifecycle: requests in flight (leases), sleep after idle, wake on demand.

With ``--sleep-idle-seconds N`` (llama-server's flag) a model whose app has had no request in
flight and no queued or running job for N seconds falls asleep: ``ModelHost.sleep`` drops the
RAM tier's expert pages and frees the engine, while the server keeps answering. A request
that needs the model wakes it first (``ModelHost.wake``, the same load as at start) and its
answer's ``timings.wake_ms`` says how long it waited. Requests that only read (GET, HEAD,
OPTIONS: ``/health``, ``/props``, ``/metrics``, ``/models``, the chat page ...) never wake
it: ``/props`` answers with ``is_sleeping: true`` and ``/metrics`` with the text rendered as
the model fell asleep (llama-server's snapshot: the last text served awake when the model
did no work after it), both from ``Lifecycle.snapshot``.

Invariants: ``leases`` counts requests inside the app (``LifecycleGate``) plus holds taken by
a router between choosing this model and forwarding to it; a model sleeps only with no lease,
an idle queue and ``idle_seconds`` since the last request that needed it ended (read-only
requests do not move that timer, as in llama-server); sleep and wake run under one
asyncio lock, so a request that arrives while the model falls asleep waits and then wakes it
(llama-server lost or crashed such requests: a check, then the sleep, then the task).
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import anyio
from starlette.types import ASGIApp, Receive, Scope, Send

from runtime.server.errors import APIError, route_response
from runtime.server.model_host import LoadState, ModelHost

log = logging.getLogger("moe_offload.server")

# seconds the current request waited for its model to load or wake (None: it was ready);
# shapes.llama_timings adds it to the answer's timings as ``wake_ms``
WAKE_SECONDS: ContextVar[float | None] = ContextVar("moe_offload_wake_seconds", default=None)

READ_ONLY_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
# POST routes that need no model: they never wake it
NO_MODEL_POSTS = frozenset({"/cors-proxy", "/v1/streams/lookup"})


def wakes_model(scope: Scope) -> bool:
    """Whether this request needs the engine (and so wakes a sleeping model)."""
    return scope.get("method") not in READ_ONLY_METHODS \
        and scope.get("path") not in NO_MODEL_POSTS


def idle_enough(leases: int, queue_busy: bool, last_used: float, now: float,
                idle_seconds: float | None) -> bool:
    """The sleep rule: nothing in flight or queued for ``idle_seconds`` (None: never)."""
    return idle_seconds is not None and leases == 0 and not queue_busy \
        and now - last_used >= idle_seconds


@dataclass(frozen=True)
class Snapshot:
    """What the read-only routes answer while the model sleeps (taken as it falls asleep)."""

    props: dict[str, Any]
    metrics: str | None


class Lifecycle:
    """Leases, the idle timer, sleep and wake of one model app. Event-loop thread only."""

    def __init__(self, host: ModelHost, *, idle_seconds: float | None,
                 queue_busy: Callable[[], bool],
                 take_snapshot: Callable[[], Snapshot] | None = None,
                 on_change: Callable[[str], None] | None = None,
                 on_idle: Callable[[], None] | None = None) -> None:
        """``idle_seconds``: None never sleeps; ``queue_busy()``: a job runs or waits;
        ``take_snapshot()``: the read-only answers to keep while asleep; ``on_change(status)``
        ("sleeping", "loading", "loaded"): a router's status feed; ``on_idle()``: the last
        lease ended (a router waiting for an idle model to unload)."""
        if idle_seconds is not None and idle_seconds < 0:
            raise ValueError("idle_seconds must be >= 0 or None")
        self.host = host
        self.idle_seconds = idle_seconds
        self.leases = 0
        self.last_used = time.monotonic()     # monotonic s: the last lease's end (or start)
        self.snapshot: Snapshot | None = None
        self._queue_busy = queue_busy
        self._take_snapshot = take_snapshot
        self.on_change = on_change or (lambda status: None)    # settable: a router's feed
        self.on_idle = on_idle or (lambda: None)
        self._lock = asyncio.Lock()      # held by a sleep or a wake: requests wait on it
        self._metrics_served: tuple[str, float] | None = None   # (text, monotonic s)
        self._watcher: asyncio.Task | None = None

    # -- leases ------------------------------------------------------------------------------
    def hold(self) -> None:
        """A request is on its way in: this model may not sleep or be unloaded as idle."""
        self.leases += 1

    def release(self, used: bool = True) -> None:
        """The request is done; ``used``: it needed the model (a read-only request, such as
        the chat page polling ``/v1/residency``, does not keep the model awake)."""
        self.leases -= 1
        assert self.leases >= 0, "lease released twice"
        if used:
            self.last_used = time.monotonic()
        if self.leases == 0:
            self.on_idle()

    def busy(self) -> bool:
        """A request is in flight or a job is queued or running."""
        return self.leases > 0 or self._queue_busy()

    @property
    def sleeping(self) -> bool:
        return self.host.state is LoadState.SLEEPING

    def served_metrics(self, text: str) -> None:
        """``/metrics``' text as just served awake: if the model does no work before it
        falls asleep, asleep repeats exactly this (what llama-server's snapshot shows)."""
        self._metrics_served = (text, time.monotonic())

    # -- wake --------------------------------------------------------------------------------
    async def ready(self, wakes: bool) -> float | None:
        """Wake the model when ``wakes`` and it sleeps (or is falling asleep, or waking: the
        lock is held); the seconds this request waited for that, or None. A failed wake is a
        503 naming why."""
        if not wakes or (not self._lock.locked()
                         and self.host.state is not LoadState.SLEEPING):
            return None              # awake (or loading at start: the routes say so)
        t0 = time.monotonic()
        async with self._lock:
            if self.host.state is LoadState.SLEEPING:
                self.on_change("loading")
                ok = await anyio.to_thread.run_sync(self.host.wake)
                self.on_change("loaded" if ok else "sleeping")
                if ok:
                    log.info("model %s woke in %.2f s", self.host.model_id,
                             time.monotonic() - t0)
                    self.snapshot = None
            if self.host.state is not LoadState.READY:
                raise APIError(503, f"Waking the model failed: {self.host.error}",
                               code="model_load_failed")
        return time.monotonic() - t0

    # -- sleep -------------------------------------------------------------------------------
    async def sleep_if_idle(self, now: float) -> bool:
        """Put the model to sleep when the sleep rule holds at ``now`` (monotonic s)."""
        if not idle_enough(self.leases, self._queue_busy(), self.last_used, now,
                           self.idle_seconds) or self.host.state is not LoadState.READY:
            return False
        async with self._lock:        # re-checked: a request may have come in meanwhile
            if not idle_enough(self.leases, self._queue_busy(), self.last_used,
                               time.monotonic(), self.idle_seconds) \
                    or self.host.state is not LoadState.READY:
                return False
            if self._take_snapshot is not None:
                snapshot = self._take_snapshot()
                served = self._metrics_served
                if served is not None and served[1] >= self.last_used \
                        and snapshot.metrics is not None:
                    snapshot = Snapshot(snapshot.props, served[0])
                self.snapshot = snapshot
            asleep = await anyio.to_thread.run_sync(self.host.sleep)
            if asleep:
                self.on_change("sleeping")
            return asleep

    def start(self) -> None:
        """Start the idle watcher (on the running loop) when the model may sleep."""
        if self.idle_seconds is None or self._watcher is not None:
            return
        self.last_used = time.monotonic()
        self._watcher = asyncio.get_running_loop().create_task(self._watch())

    def stop(self) -> None:
        if self._watcher is not None:
            self._watcher.cancel()
            self._watcher = None

    async def _watch(self) -> None:
        interval = min(1.0, max(0.05, self.idle_seconds / 4))     # s between checks
        while True:
            await asyncio.sleep(interval)
            try:
                await self.sleep_if_idle(time.monotonic())
            except Exception:  # noqa: BLE001 - the watcher must outlive one failed sleep
                log.exception("putting model %s to sleep failed", self.host.model_id)


class LifecycleGate:
    """ASGI middleware: every HTTP request holds a lease while inside the app; one that
    needs the model wakes it first (``WAKE_SECONDS`` then holds how long that took)."""

    def __init__(self, app: ASGIApp, lifecycle: Lifecycle) -> None:
        self.app = app
        self.lifecycle = lifecycle

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        lifecycle = self.lifecycle
        wakes = wakes_model(scope)
        lifecycle.hold()
        try:
            try:
                waited = await lifecycle.ready(wakes)
            except APIError as err:
                await route_response(scope.get("path", ""), err)(scope, receive, send)
                return
            if waited is not None:
                WAKE_SECONDS.set(waited + (WAKE_SECONDS.get() or 0.0))
            await self.app(scope, receive, send)
        finally:
            lifecycle.release(used=wakes)
