"""Resumable streams, as llama-server's (tools/server/server-stream.cpp).

A streamed completion sent with ``X-Conversation-Id: ID`` keeps generating when its client
goes away: its SSE bytes go into a session buffer (the last ``MAX_BYTES``) that readers drain
from any byte offset. ``GET /v1/stream?conv_id=ID&from=N`` replays from byte ``N`` and then
follows the live bytes until the answer ends; ``POST /v1/streams/lookup`` with
``{"conversation_ids": [...]}`` says which of those ids have a session (never lists others);
``DELETE /v1/stream?conv_id=ID`` stops the generation and drops the session (204, also for an
unknown id). A new stream on the same id replaces (and stops) the old one; a finished session
is dropped ``TTL_S`` after its end.

Everything here runs on the server's event loop: no locks. The producer is a task that drains
the route's payloads into the session; the HTTP answer is one more reader of it.
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from runtime.server.errors import APIError
from runtime.server.requests import json_object

HEADER = "x-conversation-id"
MAX_BYTES = 4 << 20          # bytes of a session kept for readers (the oldest are dropped)
TTL_S = 300                  # seconds a finished session stays readable

router = APIRouter()


class OffsetLost(Exception):
    """The bytes from that offset on were dropped (the session passed MAX_BYTES)."""


class StreamSession:
    """One conversation's stream: a byte buffer that keeps its last ``cap`` bytes."""

    def __init__(self, conversation_id: str, cap: int = MAX_BYTES) -> None:
        self.conversation_id = conversation_id
        self.cap = cap
        self.started_at = int(time.time())
        self.completed_at = 0          # unix seconds once done
        self._buffer = bytearray()
        self.dropped = 0               # bytes dropped from the front
        self.done = False
        self._changed = asyncio.Event()
        self.producer: asyncio.Task | None = None

    @property
    def total_bytes(self) -> int:
        return self.dropped + len(self._buffer)

    def append(self, data: bytes) -> None:
        if self.done or not data:
            return
        self._buffer += data
        over = len(self._buffer) - self.cap
        if over > 0:
            del self._buffer[:over]
            self.dropped += over
        self._wake()

    def finish(self) -> None:
        if not self.done:
            self.done, self.completed_at = True, int(time.time())
            self._wake()

    def stop(self) -> None:
        """Stop the producer (and so the generation) and end the session."""
        if self.producer is not None and not self.producer.done():
            self.producer.cancel()
        self.finish()

    def _wake(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    async def read_from(self, offset: int) -> AsyncIterator[bytes]:
        """The bytes from ``offset`` on, then the live ones until the session ends."""
        while True:
            if offset < self.dropped:
                raise OffsetLost(offset)
            end = self.total_bytes
            if offset < end:
                chunk = bytes(self._buffer[offset - self.dropped:])
                offset = end
                yield chunk
                continue
            if self.done:
                return
            await self._changed.wait()


class StreamSessions:
    """The live sessions by conversation id (one at most per id)."""

    def __init__(self) -> None:
        self._sessions: dict[str, StreamSession] = {}

    def _expire(self, now: float) -> None:
        for key in [k for k, s in self._sessions.items()
                    if s.done and s.completed_at and now - s.completed_at >= TTL_S]:
            del self._sessions[key]

    def get(self, conversation_id: str) -> StreamSession | None:
        self._expire(time.time())
        return self._sessions.get(conversation_id)

    def lookup(self, ids: list[str]) -> list[StreamSession]:
        """Sessions of these ids: the id itself or ``ID::model`` (llama-server's keys)."""
        self._expire(time.time())
        return [s for rid in ids for key, s in self._sessions.items()
                if key == rid or key.startswith(rid + "::")]

    def start(self, conversation_id: str, payloads: AsyncIterator[str]) -> StreamSession:
        """A new session fed by ``payloads`` (SSE data fields), replacing the id's old one."""
        self.stop(conversation_id)
        session = StreamSession(conversation_id)
        self._sessions[conversation_id] = session

        async def produce() -> None:
            try:
                async for payload in payloads:
                    session.append(f"data: {payload}\n\n".encode())
            finally:
                await payloads.aclose()      # its own cleanup: the engine job is cancelled
                session.finish()
        session.producer = asyncio.get_running_loop().create_task(produce())
        return session

    def stop(self, conversation_id: str) -> None:
        session = self._sessions.pop(conversation_id, None)
        if session is not None:
            session.stop()

    def stop_all(self) -> None:
        for key in list(self._sessions):
            self.stop(key)


def _sse_response(session: StreamSession, offset: int) -> StreamingResponse:
    async def body() -> AsyncIterator[bytes]:
        try:
            async for chunk in session.read_from(offset):
                yield chunk
        except OffsetLost:           # dropped while this reader lagged: end the answer
            return
    return StreamingResponse(body(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache"})


def resumable(request: Request, payloads: AsyncIterator[str]) -> StreamingResponse | None:
    """With ``X-Conversation-Id``: start its session on ``payloads`` and answer as its first
    reader; None without the header (the route streams as usual)."""
    conversation_id = request.headers.get(HEADER, "")
    if not conversation_id:
        return None
    session = request.app.state.streams.start(conversation_id, payloads)
    return _sse_response(session, 0)


def _conversation_id(request: Request) -> str:
    conversation_id = request.query_params.get("conv_id", "")
    if not conversation_id:
        raise APIError(400, "Missing conversation id (conv_id)", param="conv_id",
                       code="invalid_value")
    return conversation_id


@router.get("/v1/stream")
async def replay(request: Request) -> StreamingResponse:
    """The session's SSE bytes from byte ``from`` (0 by default), then its live ones."""
    session = request.app.state.streams.get(_conversation_id(request))
    if session is None:
        raise APIError(404, "Stream not found or expired", code="not_found",
                       error_type="not_found_error")
    raw = request.query_params.get("from", "0") or "0"
    if not raw.isdigit():
        raise APIError(400, "Invalid 'from' offset", param="from", code="invalid_value")
    if int(raw) < session.dropped:
        raise APIError(400, "Stream offset lost, please restart", param="from",
                       code="offset_lost")
    return _sse_response(session, int(raw))


@router.post("/v1/streams/lookup")
async def lookup(request: Request) -> JSONResponse:
    """The sessions of the ids asked for (only those: live ids are never listed)."""
    return JSONResponse(lookup_answer(await json_object(request),
                                      [request.app.state.streams]))


def lookup_answer(body: dict, stores: list[StreamSessions]) -> list[dict]:
    """``/v1/streams/lookup``'s answer over one or more session stores (a router's models)."""
    extra = sorted(set(body) - {"conversation_ids"})
    if extra:
        raise APIError(400, f"Unknown field {extra[0]!r}: the lookup takes conversation_ids",
                       param=extra[0], code="invalid_value")
    ids = body.get("conversation_ids")
    if not isinstance(ids, list) or not all(isinstance(i, str) and i for i in ids):
        raise APIError(400, "conversation_ids must be a list of conversation ids (non-empty "
                            "strings)", param="conversation_ids", code="invalid_value")
    return [{"conversation_id": s.conversation_id, "is_done": s.done,
             "total_bytes": s.total_bytes, "started_at": s.started_at,
             "completed_at": s.completed_at}
            for store in stores for s in store.lookup(ids)]


@router.delete("/v1/stream")
async def stop(request: Request) -> Response:
    """The user's Stop: the generation ends and the session is dropped."""
    request.app.state.streams.stop(_conversation_id(request))
    return Response(status_code=204)
