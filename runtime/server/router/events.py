"""``GET /models/sse``: every model's status changes, as llama-server sends them.

An event is ``{"model": NAME, "event": KIND, "data": {...}}``: ``model_status`` when a load
starts (``{"status": "loading"}``), ``status_change`` at each change after
(``{"status": "loaded" | "sleeping" | "unloaded" | "loading", ...}``; an unload carries
``exit_code`` as llama-server's, 0 here, and ours adds ``reason`` when the router chose it:
an LRU eviction says for which model and which budget). Event-loop thread only.
"""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

QUEUE_MAX = 256      # events one slow subscriber may lag behind before it is dropped


class ModelEvents:
    def __init__(self) -> None:
        self._subscribers: set[asyncio.Queue] = set()

    def publish(self, event: str, model: str, data: dict[str, Any] | None = None) -> None:
        message = {"model": model, "event": event}
        if data is not None:
            message["data"] = data
        for queue in list(self._subscribers):
            try:
                queue.put_nowait(message)
            except asyncio.QueueFull:       # a reader this far behind is gone in all but name
                self._subscribers.discard(queue)

    def subscribe(self) -> AsyncIterator[dict[str, Any]]:
        """The events from now on (the subscription starts at this call, before the first
        ``__anext__``: a response's headers go out before its body is iterated), until the
        consumer stops iterating."""
        queue: asyncio.Queue = asyncio.Queue(QUEUE_MAX)
        self._subscribers.add(queue)

        async def follow() -> AsyncIterator[dict[str, Any]]:
            try:
                while True:
                    yield await queue.get()
            finally:
                self._subscribers.discard(queue)
        return follow()
