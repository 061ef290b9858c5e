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
from fastapi.responses import JSONResponse, Response
from sse_starlette import EventSourceResponse

from runtime.engine.types import CANCELLED, ContextLengthError, KVCacheFullError
from runtime.errors import UserError
from runtime.server import shapes, structured
from runtime.server.errors import APIError
from runtime.server.limits import check_request
from runtime.server.prepare import Prepared, context_error, prepare_chat, prepare_completion
from runtime.server.queue import Job, QueueClosed, QueueFull
from runtime.server.schemas import ChatCompletionRequest, CompletionRequest
from runtime.server.chat_stream import ChatFramer
from runtime.server.reasoning import split_reasoning
from runtime.server.request_log import record_for
from runtime.server.stream_sessions import resumable

log = logging.getLogger("moe_offload.server")

router = APIRouter()



def _generation(engine: Any, prep: Prepared, metrics: Any,
                llamacpp: Any = None, record: Any = None
                ) -> Callable[[threading.Event], Iterator[Any]]:
    """The job run on the worker thread: ``(choice index, chunk)`` for each of the ``n``
    choices in turn (one KV sequence: each choice reuses the prompt's cached prefix), with
    metrics and the request log's ``record`` (request_log.GenerationRecord) kept on the way."""
    def work(cancel: threading.Event) -> Iterator[Any]:
        t0 = time.perf_counter()
        generated = 0
        batcher = getattr(engine, "batcher", None)
        if batcher is not None:          # -np > 1: the choices decode side by side
            tokens = prep.prompt if isinstance(prep.prompt, list) else \
                engine.tokenize(prep.prompt, add_special=True)
            items = batcher.generate_many(
                [(tokens, prep.choice_params(i)) for i in range(prep.n)], cancel,
                progress=prep.progress, reuse_prefix=prep.cache_prompt, id_slot=prep.id_slot)
        else:
            items = ((i, chunk) for i in range(prep.n) if not cancel.is_set()
                     for chunk in engine.generate(prep.prompt, prep.choice_params(i),
                                                  cancel=cancel, progress=prep.progress,
                                                  # later choices: this request's prompt
                                                  reuse_prefix=prep.cache_prompt or i > 0))
        try:
            for index, chunk in items:
                if chunk.token is not None:
                    generated += 1
                if chunk.timings is not None and llamacpp is not None:
                    llamacpp.observe(chunk.timings, prep.prompt_tokens)
                yield index, chunk
        finally:
            seconds = time.perf_counter() - t0
            metrics.observe_generation(prep.prompt_tokens, generated, seconds)
            if record is not None:
                record.add(prep.prompt_tokens, generated, seconds)
    return work


def _engine_failure(exc: BaseException) -> APIError:
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, ContextLengthError):
        return context_error(exc.prompt_tokens, exc.n_ctx, "prompt")
    from runtime.rpc.setup import RemoteDeviceLost  # noqa: PLC0415

    if isinstance(exc, RemoteDeviceLost):
        log.error("generation failed: %s", exc)
        return APIError(503, str(exc), code="remote_device_down")
    if isinstance(exc, UserError):
        return APIError(400, str(exc), code="invalid_request")
    if isinstance(exc, KVCacheFullError):       # llama-server's answer: the pool is aborted
        return APIError(500, str(exc), code="context_full")
    log.error("generation failed: %s: %s", type(exc).__name__, exc)
    return APIError(500, f"Generation failed: {type(exc).__name__}: {exc}", code="internal_error")


async def _submit(request: Request, prepare: Callable[[Any], Prepared],
                  body: Any = None) -> tuple[Prepared, Job]:
    """Check ``body``'s grammars and schemas against the limits, prepare the request off the
    event loop, then queue its generation (429 when full)."""
    state = request.app.state
    if state.settings.embedding:
        raise APIError(501, "This server does not support completions. Start it without "
                            "`--embeddings`", code="not_supported",
                       error_type="not_supported_error")
    engine = state.host.engine()                      # 503 while loading
    if body is not None:
        check_request(body, state.settings.limits)
    try:
        prep = await anyio.to_thread.run_sync(prepare, engine)
    except APIError:
        raise
    except Exception as exc:  # noqa: BLE001 - tokenizer/template trouble is answered, not fatal
        raise _engine_failure(exc) from exc
    try:
        job = state.queue.submit(_generation(engine, prep, state.metrics,
                                             getattr(state, "llamacpp", None),
                                             record_for(request)))
    except QueueClosed as exc:
        raise APIError(503, "The server is shutting down.", code="server_shutdown") from exc
    except QueueFull as exc:
        state.metrics.observe_queue_full()
        raise APIError(429, f"The server is busy ({exc}); retry later.",
                       code="queue_full", headers={"Retry-After": "1"}) from exc
    return prep, job


async def _collect(request: Request, job: Job, prep: Prepared) -> list[shapes.ChoiceResult]:
    """Gather every choice of a whole answer; stop the generation if the client disconnects
    meanwhile."""
    results = [shapes.ChoiceResult(i) for i in range(prep.n)]

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
                async for index, chunk in job:
                    result = results[index]
                    result.pieces.append(chunk.text or "")
                    result.completion_tokens += chunk.token is not None
                    if chunk.token is not None:
                        result.tokens.append(chunk.token)
                    if chunk.timings is not None:
                        result.timings = chunk.timings
                    if chunk.logprob is not None:
                        result.logprobs.append(chunk.logprob)
                    if chunk.finish_reason is not None:
                        result.finish_reason = chunk.finish_reason
            except Exception as exc:  # noqa: BLE001 - kept out of the task group's error group
                error = exc
            tg.cancel_scope.cancel()
    finally:
        job.cancel.set()          # no-op when finished; stops the engine when we bailed out
    if error is not None:
        raise _engine_failure(error) from error
    if prep.n and any(r.finish_reason in (None, CANCELLED) for r in results):
        # cut short: the client left (nobody reads this) or the server is stopping
        raise APIError(503, "The server is shutting down; the answer was cut short.",
                       code="server_shutdown")
    return results


def _sse(payload: dict) -> str:
    return json.dumps(payload, ensure_ascii=False, separators=(",", ":"))


SHUTDOWN_GRACE_S = 2.0   # a stream's time to end cleanly on shutdown (< uvicorn's 3 s drain)


async def chat_frames(job: Job, prep: Prepared, include_usage: bool, framer: Any,
                      shutdown: anyio.Event) -> AsyncIterator[dict]:
    """The frames of a streamed answer as dicts: the framer's opening frames, its frames per
    chunk and per finished choice, an optional usage frame. An engine error, or a server
    shutdown that cuts the answer short, is raised as an ``APIError`` once the frames before
    it are out. The Anthropic and Responses streams translate these same frames."""
    generated = 0
    finished = 0
    timings = None
    extra = {"usage": None} if include_usage else {}
    try:
        for frame in framer.opening():
            yield frame | extra
        async for index, chunk in job:
            if shutdown.is_set():
                job.cancel.set()      # the worker stops this generation
            generated += chunk.token is not None
            timings = chunk.timings or timings
            for frame in framer.chunk(index, chunk):
                yield frame | extra
            if chunk.finish_reason not in (None, CANCELLED):
                finished += 1
    except Exception as exc:  # noqa: BLE001 - reported in-band by the caller
        raise _engine_failure(exc) from exc
    finally:
        job.cancel.set()          # the client left (or we are done): free the engine
    if finished < prep.n:
        # cancelled while the client is still here: only a shutdown does that
        raise APIError(503, "The server is shutting down; the answer was cut short.",
                       code="server_shutdown")
    if include_usage:
        frame = framer.base | {"choices": [], "usage": shapes.usage(prep.prompt_tokens,
                                                                    generated)}
        if getattr(framer, "timings", False) and timings is not None:
            frame["timings"] = shapes.llama_timings(timings, prep.prompt_tokens)
        yield frame


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
    return await _submit(request, lambda e: prepare_chat(
        e, body, defaults, settings.reasoning, settings.reasoning_format,
        limits=settings.limits), body)


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
        answer["__verbose"] = {"prompt": prep.prompt}
    return JSONResponse(answer)


async def chat_answer(request: Request, body: ChatCompletionRequest, prep: Prepared, job: Job,
                      base: dict) -> dict:
    """The whole ``chat.completion`` answer of a queued request."""
    results = await _collect(request, job, prep)
    choices = []
    for r in results:
        reasoning, text = (None, r.text) if prep.thinking is None else \
            split_reasoning(r.text, prep.thinking)
        message: dict[str, Any] = {"role": "assistant", "content": text}
        finish = r.finish_reason
        if prep.tool_format is not None:
            content, calls = structured.parse_tool_calls(text, prep.tool_format)
            if calls:
                message = {"role": "assistant", "content": content,
                           "tool_calls": [c.to_openai() for c in calls]}
                finish = "tool_calls"
        if reasoning is not None:
            message["reasoning_content"] = reasoning
        logprobs = {"content": [shapes.chat_logprob(lp) for lp in r.logprobs],
                    "refusal": None} if prep.params.logprobs is not None else None
        choices.append({"index": r.index, "message": message, "logprobs": logprobs,
                        "finish_reason": finish})
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


@router.post("/chat/completions/input_tokens")
@router.post("/v1/chat/completions/input_tokens")
async def chat_input_tokens(body: ChatCompletionRequest, request: Request) -> dict:
    """How many prompt tokens the request would take (llama-server's)."""
    engine = request.app.state.host.engine()
    check_request(body, request.app.state.settings.limits)
    prep = await anyio.to_thread.run_sync(prepare_chat, engine, body, None,
                                          request.app.state.settings.reasoning)
    return {"input_tokens": prep.prompt_tokens}


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request):
    """OpenAI text completion, streamed or not (``n`` choices, logprobs, echo)."""
    defaults, limits = request.app.state.defaults, request.app.state.settings.limits
    prep, job = await _submit(request, lambda e: prepare_completion(e, body, defaults,
                                                                    limits=limits), body)
    cid, created = _ids("cmpl")
    base = {"id": cid, "object": "text_completion", "created": created,
            "model": request.app.state.host.model_id, "system_fingerprint": fingerprint(request)}
    want_lp = prep.params.logprobs is not None

    if body.stream:
        return _event_source(request, job, prep, body.include_usage_in_stream(),
                             CompletionFramer(base, prep))
    results = await _collect(request, job, prep)
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
