"""Holds one model's engine, loaded on a background thread, and puts it to sleep.

The server starts listening before the model is loaded so that ``/health`` can say "loading"
(503) and then "ok" (200). Requests that need the engine get a 503 until it is ready.

Sleep (``--sleep-idle-seconds``, driven by lifecycle.py): ``sleep()`` frees the engine (the
RAM tier's expert pages leave the page cache first, see ``free_ram_tier``) and ``wake()``
loads it again with the same factory. States: LOADING -> READY | FAILED; READY -> SLEEPING
-> LOADING (a wake) -> READY | FAILED.
"""
from __future__ import annotations

import enum
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from runtime.server.errors import APIError

log = logging.getLogger("moe_offload.server")

# One engine loads at a time in a process (a router's models, their wakes): llama.cpp's load
# log capture and the engine's memory check (runtime/engine/memory_check.py) see one load.
_ONE_LOAD = threading.Lock()


class LoadState(enum.Enum):
    LOADING = "loading"
    READY = "ready"
    FAILED = "failed"
    SLEEPING = "sleeping"       # loaded once, engine freed until a request wakes it


class ModelHost:
    """Loads the engine once with ``load()`` (a blocking factory) and hands it out when ready."""

    def __init__(self, load: Callable[[], Any], model_id: str) -> None:
        self.model_id = model_id
        self._load_engine = load
        self._lock = threading.Lock()
        self._state = LoadState.LOADING
        self._engine: Any = None
        self._error: str | None = None
        self._closed = False
        self.load_seconds: float | None = None      # the last load's (or wake's), s
        self._thread: threading.Thread | None = None
        self._settled = threading.Event()           # set when a load attempt has ended
        self._on_ready: Callable[[], None] | None = None
        self._on_failure: Callable[[str], None] | None = None

    @property
    def state(self) -> LoadState:
        with self._lock:
            return self._state

    @property
    def error(self) -> str | None:
        with self._lock:
            return self._error

    def start(self, on_ready: Callable[[], None] | None = None,
              on_failure: Callable[[str], None] | None = None) -> None:
        """Load on a daemon thread; then call ``on_ready()`` or ``on_failure(message)``."""
        self._on_ready, self._on_failure = on_ready, on_failure
        self._thread = threading.Thread(target=self._load, args=(True,),
                                        name="moe-offload-loader", daemon=True)
        self._thread.start()

    def wait_settled(self, timeout: float | None = None) -> bool:
        """Block until the current load attempt has ended (loaded, failed or closed)."""
        return self._settled.wait(timeout)

    def _load(self, first: bool) -> None:
        """One load attempt. ``first``: the load at start (its callbacks run); a wake that
        fails goes back to SLEEPING, so that the next request tries again."""
        t0 = time.perf_counter()
        try:
            with _ONE_LOAD:
                engine = self._load_engine()
        except BaseException as exc:  # noqa: BLE001 - a failed load is reported, not raised
            message = str(exc) or type(exc).__name__
            with self._lock:
                self._state = LoadState.FAILED if first else LoadState.SLEEPING
                self._error = message
            self._settled.set()
            log.debug("model failed to load: %s", message)
            if first and self._on_failure is not None:
                self._on_failure(message)
            return
        with self._lock:
            close_now = self._closed        # shut down while loading: do not leak the engine
            if not close_now:
                self._engine, self._state = engine, LoadState.READY
                self.load_seconds = time.perf_counter() - t0
        self._settled.set()
        if close_now:
            _close(engine)
            return
        if first and self._on_ready is not None:
            self._on_ready()

    def sleep(self) -> bool:
        """READY -> SLEEPING: free the RAM tier's pages, then the engine (blocking: call it off
        the event loop). False (and nothing done) in any other state."""
        with self._lock:
            if self._state is not LoadState.READY:
                return False
            engine, self._engine = self._engine, None
            self._state = LoadState.SLEEPING
        freed = free_ram_tier(engine)
        _close(engine)
        log.info("model %s is asleep (engine freed%s)", self.model_id,
                 f", {freed / 2**20:.1f} MiB of RAM-tier experts dropped" if freed else "")
        return True

    def wake(self) -> bool:
        """SLEEPING -> LOADING -> READY (or back to SLEEPING, ``error`` saying why), loading
        on the calling thread (blocking). Returns whether the engine is ready afterwards."""
        with self._lock:
            if self._state is not LoadState.SLEEPING:
                return self._state is LoadState.READY
            self._state, self._error = LoadState.LOADING, None
            self._settled.clear()
        self._load(first=False)
        return self.state is LoadState.READY

    def engine(self) -> Any:
        """The loaded engine, or an ``APIError(503)`` saying why there is none yet."""
        with self._lock:
            if self._state is LoadState.READY:
                return self._engine
            if self._state is LoadState.LOADING:
                raise APIError(503, "Loading model", code="model_loading")
            if self._state is LoadState.SLEEPING:
                raise APIError(503, "The model is asleep (--sleep-idle-seconds); a generation "
                                    "request wakes it", code="model_sleeping")
            raise APIError(503, f"The model failed to load: {self._error}",
                           code="model_load_failed")

    def engine_if_ready(self) -> Any | None:
        with self._lock:
            return self._engine if self._state is LoadState.READY else None

    def close(self) -> None:
        """Close the engine (if loaded); a load still running closes its engine when done."""
        with self._lock:
            self._closed = True
            engine, self._engine = self._engine, None
            if self._state in (LoadState.READY, LoadState.SLEEPING):
                self._state, self._error = LoadState.FAILED, "the server is shutting down"
        self._settled.set()
        if engine is not None:
            _close(engine)


def free_ram_tier(engine: Any) -> int:
    """Drop the RAM tier's expert pages from the page cache (before the engine closes: the
    tier's pager needs llama.cpp's mapping). Returns the bytes ``mincore`` saw resident
    before. Closing alone would unmap them but leave them cached, counted as used RAM
    until the kernel reclaims them."""
    resident = 0
    for tier in getattr(engine, "tiers", ()):
        release = getattr(tier, "release", None)
        if release is None:                         # a device cache: its slots go with it
            continue
        try:
            resident += release()
        except OSError as exc:       # the engine still closes; the kernel reclaims the rest
            log.warning("sleeping: could not drop the RAM tier's pages (%s)", exc.strerror)
    return resident


def _close(engine: Any) -> None:
    try:
        batcher = getattr(engine, "batcher", None)
        if batcher is not None:        # its thread drives the engine: stop it first
            batcher.close()
        engine.close()
    except Exception:  # noqa: BLE001 - shutting down: log and go on
        log.exception("closing the engine failed")
