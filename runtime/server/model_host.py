"""Holds the one engine of the process, loaded on a background thread.

The server starts listening before the model is loaded so that ``/health`` can say "loading"
(503) and then "ok" (200). Requests that need the engine get a 503 until it is ready.
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


class LoadState(enum.Enum):
    LOADING = "loading"
    READY = "ready"
    FAILED = "failed"


class ModelHost:
    """Loads the engine once with ``load()`` (a blocking factory) and hands it out when ready."""

    def __init__(self, load: Callable[[], Any], model_id: str) -> None:
        self.model_id = model_id
        self._load = load
        self._lock = threading.Lock()
        self._state = LoadState.LOADING
        self._engine: Any = None
        self._error: str | None = None
        self._closed = False
        self.load_seconds: float | None = None
        self._thread: threading.Thread | None = None

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
        def run() -> None:
            t0 = time.perf_counter()
            try:
                engine = self._load()
            except BaseException as exc:  # noqa: BLE001 - a failed load is reported, not raised
                message = str(exc) or type(exc).__name__
                with self._lock:
                    self._state, self._error = LoadState.FAILED, message
                log.debug("model failed to load: %s", message)
                if on_failure is not None:
                    on_failure(message)
                return
            with self._lock:
                if self._closed:            # shut down while loading: do not leak the engine
                    close_now = True
                else:
                    close_now = False
                    self._engine, self._state = engine, LoadState.READY
                    self.load_seconds = time.perf_counter() - t0
            if close_now:
                _close(engine)
                return
            if on_ready is not None:
                on_ready()

        self._thread = threading.Thread(target=run, name="moe-offload-loader", daemon=True)
        self._thread.start()

    def engine(self) -> Any:
        """The loaded engine, or an ``APIError(503)`` saying why there is none yet."""
        with self._lock:
            if self._state is LoadState.READY:
                return self._engine
            if self._state is LoadState.LOADING:
                raise APIError(503, "Loading model", code="model_loading")
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
            if self._state is LoadState.READY:
                self._state, self._error = LoadState.FAILED, "the server is shutting down"
        if engine is not None:
            _close(engine)


def _close(engine: Any) -> None:
    try:
        batcher = getattr(engine, "batcher", None)
        if batcher is not None:        # its thread drives the engine: stop it first
            batcher.close()
        engine.close()
    except Exception:  # noqa: BLE001 - shutting down: log and go on
        log.exception("closing the engine failed")
