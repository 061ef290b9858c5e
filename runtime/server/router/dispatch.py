"""Dispatch: every request the router does not answer itself runs in its model's own app.

The model is named by a POST body's ``"model"`` or a GET's ``?model=`` (an alias too); a
resumable stream's routes (``/v1/stream?conv_id=ID``) find it from the id's ``::NAME`` suffix
or by which model holds the session. A missing or unknown name is a 400 in the route's API
shape (llama-server's messages, and the models served). The request then holds a lease on
its model (ModelRouter.acquire: loading it first unless told not to) until its answer has been
sent, so that nothing unloads the model under it, and it runs in the model's app with the
same ASGI scope (its ``state`` too: the request log reads what the model's routes write).

A resumable stream (``X-Conversation-Id``) still waiting for its model's load can be stopped
(``DELETE /v1/stream``: the waiting request answers 400 ``cancelled``), and asking to resume
it meanwhile is a 503 to retry, as llama-server's router answers.
"""
from __future__ import annotations

import asyncio
import json
from collections.abc import Callable

from starlette.datastructures import Headers
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from runtime.server.errors import APIError, route_response
from runtime.server.lifecycle import WAKE_SECONDS, wakes_model
from runtime.server.router.instance import ModelInstance
from runtime.server.router.models import ModelRouter

BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})
STREAM_PATH = "/v1/stream"     # a resumable stream: its model from its conversation id
STREAM_HEADER = "x-conversation-id"


class Dispatch:
    """ASGI middleware (innermost in the router's app): a request for a model goes to that
    model's app; ``own(scope)``: the router answers it itself."""

    def __init__(self, app: ASGIApp, router: ModelRouter,
                 own: Callable[[Scope], bool]) -> None:
        self.app = app
        self.router = router
        self._own = own
        self._parked: dict[str, asyncio.Event] = {}    # conversation id -> its stop

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or self._own(scope):
            await self.app(scope, receive, send)
            return
        body: bytes | None = None
        try:
            if self._stop_parked(scope):
                await Response(status_code=204)(scope, receive, send)
                return
            if scope.get("method") in BODY_METHODS:
                body = await _read_body(receive)
                if body is None:          # the client left while sending
                    return
            inst, autoload = self._choose(scope, body)
            if inst is None:              # a stop of no stream: nothing to do
                await Response(status_code=204)(scope, receive, send)
                return
            waited = await self._acquire(scope, inst, autoload)
        except APIError as err:
            await route_response(scope.get("path", ""), err)(scope, receive, send)
            return
        try:
            if waited is not None:
                WAKE_SECONDS.set(waited)
            child = dict(scope)           # the same "state": the request log reads it
            await inst.app(child, receive if body is None else _replay(body, receive), send)
        finally:
            self.router.release(inst, used=wakes_model(scope))

    def _choose(self, scope: Scope, body: bytes | None) -> tuple[ModelInstance | None, bool]:
        """(the model, autoload) for this request (None: nothing to forward, a stop of no
        stream); APIError naming why not."""
        query = Request(scope).query_params
        if scope.get("path") == STREAM_PATH and "model" not in query:
            return self._stream_owner(scope, query.get("conv_id", "")), False
        if body is None:
            name = query.get("model")
        else:
            try:
                parsed = json.loads(body) if body else None
            except (json.JSONDecodeError, UnicodeDecodeError):
                parsed = None
            name = parsed.get("model") if isinstance(parsed, dict) else None
        if not isinstance(name, str) or not name:
            where = "?model=NAME" if body is None else '"model" in the body'
            raise APIError(400, f"model name is missing from the request ({where}: this "
                                f"server serves several models, see GET /models)",
                           code="model_missing", param="model")
        inst = self.router.resolve(name)
        if inst is None:
            served = ", ".join(sorted(self.router.instances))
            raise APIError(400, f"model '{name}' not found (served here: {served})",
                           code="model_not_found", param="model")
        autoload = query.get("autoload")
        return inst, self.router.autoload if autoload is None else autoload in ("true", "1")

    def _stream_owner(self, scope: Scope, conversation_id: str) -> ModelInstance | None:
        """The model of a resumable stream; a 503 (retry) while the request that starts it
        waits for its model's load; a 404 for none (a stop of none: None, answered 204)."""
        inst = self.router.stream_owner(conversation_id)
        if scope.get("method") == "DELETE":
            return inst
        if conversation_id in self._parked:
            raise APIError(503, "Loading model", code="model_loading")
        if inst is None or not inst.usable():
            raise APIError(404, "Stream not found or expired", code="not_found",
                           error_type="not_found_error")
        return inst

    def _stop_parked(self, scope: Scope) -> bool:
        """``DELETE /v1/stream`` of a stream still waiting for its model: stop it there."""
        if scope.get("path") != STREAM_PATH or scope.get("method") != "DELETE":
            return False
        stop = self._parked.get(Request(scope).query_params.get("conv_id", ""))
        if stop is not None:
            stop.set()
        return stop is not None

    async def _acquire(self, scope: Scope, inst: ModelInstance, autoload: bool
                       ) -> float | None:
        """``router.acquire``; a resumable stream waiting for its model's load may be stopped
        meanwhile (then 400 ``cancelled``, and the lease its load takes is handed back)."""
        conversation_id = Headers(scope=scope).get(STREAM_HEADER)
        if not conversation_id or inst.usable():
            return await self.router.acquire(inst, autoload=autoload)
        stop = self._parked[conversation_id] = asyncio.Event()
        task = asyncio.ensure_future(self.router.acquire(inst, autoload=autoload))
        stopped = asyncio.ensure_future(stop.wait())
        try:
            await asyncio.wait({task, stopped}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stopped.cancel()
            if self._parked.get(conversation_id) is stop:
                del self._parked[conversation_id]
        if task.done():
            return task.result()

        def give_back(done: asyncio.Future) -> None:
            if not done.cancelled() and done.exception() is None:
                self.router.release(inst, used=False)
        task.add_done_callback(give_back)
        raise APIError(400, "The stream was cancelled while its model was loading",
                       code="cancelled")


async def _read_body(receive: Receive) -> bytes | None:
    chunks = []
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            return b"".join(chunks)


def _replay(body: bytes, receive: Receive) -> Receive:
    """``receive`` that gives ``body`` once, then the client's later messages (a
    disconnect: what stops a stream)."""
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()
    return replay
