"""``POST /v1/chat/completions`` and ``POST /v1/completions``: prepare, queue, answer.

A request is checked on the event loop (fields, then prompt length against the context), then
queued (``jobs.submit``); the engine generates on the queue's worker thread and the chunks come
back here, either collected into one JSON answer or streamed as server-sent events ending with
``data: [DONE]``.
"""
from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import anyio
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from sse_starlette import EventSourceResponse

from runtime.engine.types import CANCELLED
from runtime.server import shapes, structured
from runtime.server.chat_stream import ChatFramer
from runtime.server.errors import APIError
from runtime.server.jobs import (SHUTDOWN_GRACE_S, chat_frames, collect, side_work,
                                 submit)
from runtime.server.requests import Prepared, prepare_chat, prepare_completion
from runtime.server.queue import Job
from runtime.server.reasoning import split_reasoning
from runtime.server.schemas import ChatCompletionRequest, CompletionRequest
from runtime.server.stream_sessions import resumable

router = APIRouter()


def _sse(payload: dict) -> str:
    return json.dumps(payload, ensure_ascii=False, separators=(",", ":"))


async def _stream(job: Job, prep: Prepared, include_usage: bool, framer: Any,
                  shutdown: anyio.Event) -> AsyncIterator[str]:
    """SSE payloads: the frames, then ``[DONE]``; an error becomes an OpenAI error frame
    instead of the end."""
    try:
        async for frame in chat_frames(job, prep, include_usage, framer, shutdown):
            yield _sse(frame)
        yield "[DONE]"
    except APIError as err:   # headers are sent: report in-band, end the stream
        yield _sse(err.body())
    finally:
        job.cancel.set()


def _event_source(request: Request, job: Job, prep: Prepared, include_usage: bool,
                  framer: Any) -> Response:
    shutdown = anyio.Event()     # set by sse-starlette when the server begins to stop
    payloads = _stream(job, prep, include_usage, framer, shutdown)
    return resumable(request, payloads) or EventSourceResponse(
        payloads, shutdown_event=shutdown, shutdown_grace_period=SHUTDOWN_GRACE_S)


def _ids(prefix: str) -> tuple[str, int]:
    return f"{prefix}-{uuid.uuid4().hex[:24]}", int(time.time())


def fingerprint(request: Request) -> str:
    return request.app.state.fingerprint


async def submit_chat(request: Request, body: ChatCompletionRequest) -> tuple[Prepared, Job]:
    """Prepare and queue a chat request (the Anthropic and Responses routes come here too)."""
    defaults, settings = request.app.state.defaults, request.app.state.settings
    return await submit(request, lambda e: prepare_chat(
        e, body, defaults, settings.reasoning, settings.reasoning_format,
        limits=settings.limits))


def chat_base(request: Request) -> dict:
    """The fields every chunk and answer of one chat completion carries."""
    cid, created = _ids("chatcmpl")
    return {"id": cid, "object": "chat.completion.chunk", "created": created,
            "model": request.app.state.host.model_id, "system_fingerprint": fingerprint(request)}


@router.post("/v1/chat/completions")
@router.post("/chat/completions", include_in_schema=False)
async def chat_completions(body: ChatCompletionRequest, request: Request):
    """OpenAI chat completion, streamed or not (``n`` choices, logprobs, tools)."""
    prep, job = await submit_chat(request, body)
    base = chat_base(request)
    if body.stream:
        return _event_source(request, job, prep, body.include_usage_in_stream(),
                             ChatFramer(base, prep, timings=body.timings_per_token))
    answer = await chat_answer(request, body, prep, job, base)
    if request.app.state.settings.verbose or body.verbose:   # llama-server's: the prompt too
        answer["__verbose"] = {"prompt": getattr(prep.prompt, "text", prep.prompt)}
    return JSONResponse(answer)


async def chat_answer(request: Request, body: ChatCompletionRequest, prep: Prepared, job: Job,
                      base: dict) -> dict:
    """The whole ``chat.completion`` answer of a queued request."""
    results = await collect(request, job, prep)
    choices = []
    for r in results:
        reasoning, text = (None, r.text) if prep.thinking is None else \
            split_reasoning(r.text, prep.thinking)
        message: dict[str, Any] = {"role": "assistant", "content": text}
        finish, note = r.finish_reason, None
        if prep.tool_format is not None:
            content, calls = structured.parse_tool_calls(text, prep.tool_format)
            if calls:
                message = {"role": "assistant", "content": content,
                           "tool_calls": [c.to_openai() for c in calls]}
                finish = "tool_calls"
            elif finish == "length" and structured.began_tool_call(text, prep.tool_format):
                note = structured.cut_call_note(prep.params.max_tokens)
        if reasoning is not None:
            message["reasoning_content"] = reasoning
        logprobs = {"content": [shapes.chat_logprob(lp) for lp in r.logprobs],
                    "refusal": None} if prep.params.logprobs is not None else None
        choices.append({"index": r.index, "message": message, "logprobs": logprobs,
                        "finish_reason": finish} | ({"note": note} if note else {}))
    answer = base | {"object": "chat.completion", "choices": choices,
                     "usage": _usage_with_cache(prep, results)}
    if results and results[0].timings is not None:        # llama-server's, always there
        answer["timings"] = shapes.llama_timings(results[0].timings, prep.prompt_tokens)
    return answer


def _usage_with_cache(prep: Prepared, results: list) -> dict:
    """OpenAI usage, with the prompt tokens served from the KV cache (llama-server's)."""
    usage = shapes.usage(prep.prompt_tokens, sum(r.completion_tokens for r in results))
    timings = results[0].timings if results else None
    if timings is not None:
        usage["prompt_tokens_details"] = {
            "cached_tokens": max(0, prep.prompt_tokens - timings.prompt_tokens)}
    return usage


async def count_chat_tokens(request: Request, body: ChatCompletionRequest) -> int:
    """The prompt tokens a chat request would take, counted on the side pool (its template
    rendered, its schemas checked; 429 when the pool is full)."""
    engine = request.app.state.host.engine()
    settings = request.app.state.settings
    prep = await side_work(request, lambda: prepare_chat(
        engine, body, None, settings.reasoning, settings.reasoning_format,
        limits=settings.limits))
    return prep.prompt_tokens


@router.post("/chat/completions/input_tokens")
@router.post("/v1/chat/completions/input_tokens")
async def chat_input_tokens(body: ChatCompletionRequest, request: Request) -> dict:
    """How many prompt tokens the request would take (llama-server's)."""
    return {"input_tokens": await count_chat_tokens(request, body)}


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request):
    """OpenAI text completion, streamed or not (``n`` choices, logprobs, echo)."""
    defaults, limits = request.app.state.defaults, request.app.state.settings.limits
    prep, job = await submit(request, lambda e: prepare_completion(e, body, defaults,
                                                                    limits=limits))
    cid, created = _ids("cmpl")
    base = {"id": cid, "object": "text_completion", "created": created,
            "model": request.app.state.host.model_id, "system_fingerprint": fingerprint(request)}
    want_lp = prep.params.logprobs is not None

    if body.stream:
        return _event_source(request, job, prep, body.include_usage_in_stream(),
                             CompletionFramer(base, prep))
    results = await collect(request, job, prep)
    choices = [{"index": r.index, "text": prep.echo_text + r.text,
                "logprobs": shapes.completion_logprobs(r.logprobs, len(prep.echo_text))
                if want_lp else None, "finish_reason": r.finish_reason} for r in results]
    return JSONResponse(base | {"choices": choices, "usage": _usage_with_cache(prep, results)})


class CompletionFramer:
    """Stream frames of a text completion (the echoed prompt first, when asked)."""

    def __init__(self, base: dict, prep: Prepared):
        self.base, self.prep = base, prep
        self._offset = {i: len(prep.echo_text) for i in range(prep.n)}

    def _frame(self, index: int, text: str, finish: str | None, logprobs) -> dict:
        return self.base | {"choices": [{"index": index, "text": text, "logprobs": logprobs,
                                         "finish_reason": finish}]}

    def opening(self) -> list[dict]:
        if not self.prep.echo_text:
            return []
        return [self._frame(i, self.prep.echo_text, None, None) for i in range(self.prep.n)]

    def chunk(self, index: int, chunk: Any) -> list[dict]:
        frames = []
        if chunk.text or chunk.logprob is not None:
            lp = None
            if chunk.logprob is not None:
                lp = shapes.completion_logprobs([chunk.logprob], self._offset[index])
                self._offset[index] += len(lp["tokens"][0])
            frames.append(self._frame(index, chunk.text or "", None, lp))
        if chunk.finish_reason not in (None, CANCELLED):
            frames.append(self._frame(index, "", chunk.finish_reason, None))
        return frames
