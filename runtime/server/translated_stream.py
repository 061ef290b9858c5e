"""A streamed chat answer sent in another API's events (the Anthropic Messages and OpenAI
Responses APIs): the chat path's frames (``chat_frames``) go through a translator — an object
with ``opening()``, ``feed(frame)`` and ``closing()``, each giving that API's events as dicts
with a ``type`` — and leave as SSE events named by their type (both clients dispatch on the
name). An error once the headers are out ends the stream with the API's own error event."""
from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from typing import Any

import anyio
from pydantic import ValidationError
from sse_starlette import EventSourceResponse

from runtime.server.chat_stream import ChatFramer
from runtime.server.jobs import SHUTDOWN_GRACE_S, chat_frames
from runtime.server.errors import APIError, pydantic_error
from runtime.server.requests import Prepared
from runtime.server.queue import Job
from runtime.server.schemas import ChatCompletionRequest


def chat_request(fields: dict, empty_messages: bool = False) -> ChatCompletionRequest:
    """The chat request a translated one becomes (its unset fields left out); a field the chat
    schema refuses is the 400 it would be on /v1/chat/completions. ``empty_messages``: no
    message at all is a request too (the template renders just the generation prompt)."""
    try:
        return ChatCompletionRequest.model_validate(
            {k: v for k, v in fields.items() if v is not None},
            context={"empty_messages": empty_messages})
    except ValidationError as exc:
        raise pydantic_error(exc) from exc


async def translated(frames: AsyncIterator[dict], translator: Any,
                     error_event: Callable[[APIError], dict]) -> AsyncIterator[dict]:
    """The translator's events for these frames; an ``APIError`` raised by the frames ends
    them with ``error_event(err)``."""
    try:
        for event in translator.opening():
            yield event
        async for frame in frames:
            for event in translator.feed(frame):
                yield event
        for event in translator.closing():
            yield event
    except APIError as err:
        yield error_event(err)


def event_source(job: Job, prep: Prepared, base: dict, translator: Any,
                 error_event: Callable[[APIError], dict]) -> EventSourceResponse:
    """The SSE response of a queued chat request, in the translator's events."""
    shutdown = anyio.Event()     # set by sse-starlette when the server begins to stop
    # include_usage and timings: the translators read the usage and the KV cache's tokens
    frames = chat_frames(job, prep, True, ChatFramer(base, prep, timings=True), shutdown)

    async def sse() -> AsyncIterator[dict]:
        try:
            async for event in translated(frames, translator, error_event):
                yield {"event": event["type"],
                       "data": json.dumps(event, ensure_ascii=False, separators=(",", ":"))}
        finally:
            job.cancel.set()         # the client left (or we are done): free the engine
    return EventSourceResponse(sse(), shutdown_event=shutdown,
                               shutdown_grace_period=SHUTDOWN_GRACE_S)
