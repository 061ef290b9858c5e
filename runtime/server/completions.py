"""``POST /v1/chat/completions`` and ``POST /v1/completions``: prepare, queue, answer.

A request is checked on the event loop (fields, then prompt length against the context), then
queued; the engine generates on the queue's worker thread and the chunks come back here, either
collected into one JSON answer or streamed as server-sent events ending with ``data: [DONE]``.
A client that goes away (mid-stream or while waiting for a whole answer) sets the job's cancel
event: the engine stops and the next request starts.
"""
from __future__ import annotations

import json
import logging
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from typing import Any

import anyio
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from sse_starlette import EventSourceResponse

from runtime.engine.sampling import SamplingParams
from runtime.engine.types import ContextLengthError
from runtime.errors import UserError
from runtime.server.errors import APIError
from runtime.server.queue import Job, QueueClosed, QueueFull
from runtime.server.schemas import ChatCompletionRequest, CompletionRequest, _SamplingFields

log = logging.getLogger("moe_offload.server")

router = APIRouter()

DEFAULT_COMPLETION_MAX_TOKENS = 16   # OpenAI's default for /v1/completions
CANCELLED = "cancelled"              # the engine's finish_reason when the cancel event stopped it


@dataclass(frozen=True, slots=True)
class Prepared:
    """A request ready for the engine."""

    prompt: str | list[int]
    prompt_tokens: int
    params: SamplingParams


@dataclass(frozen=True, slots=True)
class Outcome:
    """What a finished generation produced (a non-streamed answer)."""

    text: str
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int


def _usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def _sampling_params(req: _SamplingFields, max_tokens: int) -> SamplingParams:
    fields: dict[str, Any] = {"max_tokens": max_tokens, "stop": req.stop_list()}
    for name in ("temperature", "top_p", "top_k", "min_p", "repeat_penalty", "seed"):
        value = getattr(req, name)
        if value is not None:
            fields[name] = value
    return SamplingParams(**fields)


def _check_context(engine: Any, n_prompt: int, max_tokens: int | None, default: int | None,
                   param: str) -> int:
    """Resolve max_tokens and refuse a request that cannot fit the context window (tokens)."""
    n_ctx = int(engine.n_ctx)
    if max_tokens is None:
        max_tokens = default if default is not None else n_ctx - n_prompt
    if n_prompt + max_tokens > n_ctx or max_tokens < 1:
        what = "messages" if param == "messages" else "prompt"
        raise APIError(
            400,
            f"This model's maximum context length is {n_ctx} tokens. However, you requested "
            f"{n_prompt + max(max_tokens, 1)} tokens ({n_prompt} in the {what}, "
            f"{max(max_tokens, 1)} in the completion). Please reduce the length of the "
            f"{what} or completion.",
            code="context_length_exceeded", param=param)
    return max_tokens


def _prepare_chat(engine: Any, req: ChatCompletionRequest) -> Prepared:
    try:
        prompt = engine.chat_prompt(req.message_dicts())
    except Exception as exc:  # noqa: BLE001 - a template refusing the messages is the client's
        raise APIError(400, f"messages: the chat template rejected them: {exc}",
                       code="invalid_value", param="messages") from exc
    n_prompt = len(engine.tokenize(prompt, add_special=True))
    max_tokens = _check_context(engine, n_prompt, req.requested_max_tokens(), None, "messages")
    return Prepared(prompt, n_prompt, _sampling_params(req, max_tokens))


def _prepare_completion(engine: Any, req: CompletionRequest) -> Prepared:
    prompt = req.prompt_input()
    if isinstance(prompt, list):
        n_vocab = getattr(engine, "n_vocab", None)
        if n_vocab is not None and any(not 0 <= t < n_vocab for t in prompt):
            raise APIError(400, f"prompt: token ids must be in [0, {n_vocab})",
                           code="invalid_value", param="prompt")
        n_prompt = len(prompt)
    else:
        n_prompt = len(engine.tokenize(prompt, add_special=True))
    max_tokens = _check_context(engine, n_prompt, req.max_tokens,
                                DEFAULT_COMPLETION_MAX_TOKENS, "prompt")
    return Prepared(prompt, n_prompt, _sampling_params(req, max_tokens))


def _generation(engine: Any, prep: Prepared,
                metrics: Any) -> Callable[[threading.Event], Iterator[Any]]:
    """The job run on the worker thread: the engine's chunks, with metrics kept on the way."""
    def work(cancel: threading.Event) -> Iterator[Any]:
        t0 = time.perf_counter()
        generated = 0
        usage = None
        finished = False
        try:
            for chunk in engine.generate(prep.prompt, prep.params, cancel=cancel):
                if chunk.token is not None:
                    generated += 1
                if chunk.usage is not None:
                    usage = chunk.usage
                if chunk.finish_reason not in (None, CANCELLED):
                    finished = True
                yield chunk
        finally:
            completion = usage.completion_tokens if usage is not None else generated
            prompt_tokens = usage.prompt_tokens if usage is not None else prep.prompt_tokens
            metrics.observe_generation(prompt_tokens, completion, time.perf_counter() - t0,
                                       cancelled=cancel.is_set() and not finished)
    return work


def _engine_failure(exc: BaseException) -> APIError:
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, ContextLengthError):
        return APIError(400, f"This model's maximum context length is {exc.n_ctx} tokens; the "
                             f"prompt has {exc.prompt_tokens}.", code="context_length_exceeded")
    if isinstance(exc, UserError):
        return APIError(400, str(exc), code="invalid_request")
    log.error("generation failed: %s: %s", type(exc).__name__, exc)
    return APIError(500, f"Generation failed: {type(exc).__name__}: {exc}", code="internal_error")


async def _submit(request: Request,
                  prepare: Callable[[Any], Prepared]) -> tuple[Prepared, Job]:
    """Prepare the request off the event loop, then queue its generation (429 when full)."""
    state = request.app.state
    engine = state.host.engine()                      # 503 while loading
    try:
        prep = await anyio.to_thread.run_sync(prepare, engine)
    except APIError:
        raise
    except Exception as exc:  # noqa: BLE001 - tokenizer/template trouble is answered, not fatal
        raise _engine_failure(exc) from exc
    try:
        job = state.queue.submit(_generation(engine, prep, state.metrics))
    except QueueClosed as exc:
        raise APIError(503, "The server is shutting down.", code="server_shutdown") from exc
    except QueueFull as exc:
        state.metrics.observe_queue_full()
        raise APIError(429, f"The server is busy ({exc}); retry later.",
                       code="queue_full", headers={"Retry-After": "1"}) from exc
    return prep, job


async def _collect(request: Request, job: Job, prep: Prepared) -> Outcome:
    """Gather a whole answer; stop the generation if the client disconnects meanwhile."""
    pieces: list[str] = []
    finish_reason = None
    usage = None
    generated = 0

    async def watch_disconnect(scope: anyio.CancelScope) -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass
        job.cancel.set()
        scope.cancel()

    error: Exception | None = None
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(watch_disconnect, tg.cancel_scope)
            try:
                async for chunk in job:
                    pieces.append(chunk.text or "")
                    generated += chunk.token is not None
                    if chunk.finish_reason is not None:
                        finish_reason = chunk.finish_reason
                    if chunk.usage is not None:
                        usage = chunk.usage
            except Exception as exc:  # noqa: BLE001 - kept out of the task group's error group
                error = exc
            tg.cancel_scope.cancel()
    finally:
        job.cancel.set()          # no-op when finished; stops the engine when we bailed out
    if error is not None:
        raise _engine_failure(error) from error
    if finish_reason in (None, CANCELLED):
        # cut short: the client left (nobody reads this) or the server is stopping
        raise APIError(503, "The server is shutting down; the answer was cut short.",
                       code="server_shutdown")
    return Outcome("".join(pieces), finish_reason,
                   usage.prompt_tokens if usage is not None else prep.prompt_tokens,
                   usage.completion_tokens if usage is not None else generated)


def _sse(payload: dict) -> str:
    return json.dumps(payload, ensure_ascii=False, separators=(",", ":"))


SHUTDOWN_GRACE_S = 2.0   # a stream's time to end cleanly on shutdown (< uvicorn's 3 s drain)


async def _stream(job: Job, prep: Prepared, include_usage: bool,
                  frame: Callable[[str | None, str | None], dict], opening: dict | None,
                  shutdown: anyio.Event) -> AsyncIterator[str]:
    """SSE payloads: optional opening frame, one frame per text piece, the finish frame, an
    optional usage frame, ``[DONE]``. An engine error, or a server shutdown that cuts the
    answer short, becomes an OpenAI error frame instead of the end."""
    usage = None
    generated = 0
    finished = False
    extra = {"usage": None} if include_usage else {}
    try:
        if opening is not None:
            yield _sse(opening | extra)
        async for chunk in job:
            if shutdown.is_set():
                job.cancel.set()      # the worker stops this generation
            generated += chunk.token is not None
            if chunk.usage is not None:
                usage = chunk.usage
            if chunk.text:
                yield _sse(frame(chunk.text, None) | extra)
            if chunk.finish_reason not in (None, CANCELLED):
                finished = True
                yield _sse(frame(None, chunk.finish_reason) | extra)
        if not finished:
            # cancelled while the client is still here: only a shutdown does that
            yield _sse(APIError(503, "The server is shutting down; the answer was cut short.",
                                code="server_shutdown").body())
            return
        if include_usage:
            last = frame(None, None)
            last["choices"] = []
            last["usage"] = _usage(usage.prompt_tokens if usage else prep.prompt_tokens,
                                   usage.completion_tokens if usage else generated)
            yield _sse(last)
        yield "[DONE]"
    except Exception as exc:  # noqa: BLE001 - headers are sent: report in-band, end the stream
        yield _sse(_engine_failure(exc).body())
    finally:
        job.cancel.set()          # the client left (or we are done): free the engine


def _event_source(job: Job, prep: Prepared, include_usage: bool,
                  frame: Callable[[str | None, str | None], dict],
                  opening: dict | None = None) -> EventSourceResponse:
    shutdown = anyio.Event()     # set by sse-starlette when the server begins to stop
    return EventSourceResponse(_stream(job, prep, include_usage, frame, opening, shutdown),
                               shutdown_event=shutdown, shutdown_grace_period=SHUTDOWN_GRACE_S)


def _ids(prefix: str) -> tuple[str, int]:
    return f"{prefix}-{uuid.uuid4().hex[:24]}", int(time.time())


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request):
    """OpenAI chat completion, streamed or not."""
    prep, job = await _submit(request, lambda e: _prepare_chat(e, body))
    model = request.app.state.host.model_id
    cid, created = _ids("chatcmpl")
    base = {"id": cid, "object": "chat.completion.chunk", "created": created, "model": model,
            "system_fingerprint": None}

    if body.stream:
        def frame(text: str | None, finish: str | None) -> dict:
            delta = {} if text is None else {"content": text}
            return base | {"choices": [{"index": 0, "delta": delta, "logprobs": None,
                                        "finish_reason": finish}]}
        opening = base | {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                       "logprobs": None, "finish_reason": None}]}
        return _event_source(job, prep, body.include_usage_in_stream(), frame, opening)

    out = await _collect(request, job, prep)
    return JSONResponse(base | {
        "object": "chat.completion",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": out.text},
                     "logprobs": None, "finish_reason": out.finish_reason}],
        "usage": _usage(out.prompt_tokens, out.completion_tokens),
    })


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request):
    """OpenAI text completion, streamed or not."""
    prep, job = await _submit(request, lambda e: _prepare_completion(e, body))
    model = request.app.state.host.model_id
    cid, created = _ids("cmpl")
    base = {"id": cid, "object": "text_completion", "created": created, "model": model,
            "system_fingerprint": None}

    if body.stream:
        def frame(text: str | None, finish: str | None) -> dict:
            return base | {"choices": [{"index": 0, "text": text or "", "logprobs": None,
                                        "finish_reason": finish}]}
        return _event_source(job, prep, body.include_usage_in_stream(), frame)

    out = await _collect(request, job, prep)
    return JSONResponse(base | {
        "choices": [{"index": 0, "text": out.text, "logprobs": None,
                     "finish_reason": out.finish_reason}],
        "usage": _usage(out.prompt_tokens, out.completion_tokens),
    })
