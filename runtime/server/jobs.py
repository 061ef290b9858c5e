"""Queued generations shared by every generating route (OpenAI, llama-server, Anthropic,
Responses): ``submit`` checks and prepares a request and queues its generation, ``collect``
gathers a whole answer, ``chat_frames`` walks a streamed one, ``engine_failure`` turns what the
engine raised into the API error a client gets.

A client that goes away (mid-stream or while waiting for a whole answer) sets the job's cancel
event: the engine stops and the next request starts.
"""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import anyio
from fastapi import Request

from runtime.engine.projector import MediaPrompt
from runtime.engine.types import (CANCELLED, ContextLengthError, KVCacheFullError,
                                  ModelFileChanged, NonFiniteLogits, Timings)
from runtime.errors import UserError
from runtime.rpc.setup import RemoteDeviceLost
from runtime.server import shapes
from runtime.server.errors import APIError
from runtime.server.requests import Prepared, context_error
from runtime.server.queue import Job, QueueClosed, QueueFull
from runtime.server.request_log import record_for

log = logging.getLogger("moe_offload.server")


def generation(engine: Any, prep: Prepared, metrics: Any,
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
            tokens = prep.prompt if isinstance(prep.prompt, (list, MediaPrompt)) else \
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


def engine_failure(exc: BaseException) -> APIError:
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, ContextLengthError):
        return context_error(exc.prompt_tokens, exc.n_ctx, "prompt")
    if isinstance(exc, RemoteDeviceLost):
        log.error("generation failed: %s", exc)
        return APIError(503, str(exc), code="remote_device_down")
    if isinstance(exc, ModelFileChanged):       # every request fails until it is back: one line
        if exc.first:
            exc.first = False                   # (one exception may fail several requests)
            log.error("%s", exc)
        return APIError(503, str(exc), code="model_file_changed")
    if isinstance(exc, NonFiniteLogits):
        log.error("generation failed: %s", exc)
        return APIError(500, f"Generation failed: {exc}", code="non_finite_logits")
    if isinstance(exc, UserError):
        return APIError(400, str(exc), code="invalid_request")
    if isinstance(exc, KVCacheFullError):       # llama-server's answer: the pool is aborted
        return APIError(500, str(exc), code="context_full")
    log.error("generation failed: %s: %s", type(exc).__name__, exc)
    return APIError(500, f"Generation failed: {type(exc).__name__}: {exc}", code="internal_error")


def queue_refusal(state: Any, exc: QueueFull | QueueClosed) -> APIError:
    """The answer to a request the queue (or the side pool) cannot take: 429 with
    ``Retry-After`` when it is full, 503 when the server is stopping."""
    if isinstance(exc, QueueClosed):
        return APIError(503, "The server is shutting down.", code="server_shutdown")
    state.metrics.observe_queue_full()
    return APIError(429, f"The server is busy ({exc}); retry later.",
                    code="queue_full", headers={"Retry-After": "1"})


async def side_work(request: Request, work: Callable[[], Any]) -> Any:
    """``work()`` on the side pool (side_work.py: tokenize, templates, token counts); 429
    when its threads are busy and its waiting places taken."""
    state = request.app.state
    try:
        return await state.side_work.run(work)
    except QueueFull as exc:
        raise queue_refusal(state, exc) from exc


async def submit(request: Request, prepare: Callable[[Any], Prepared]) -> tuple[Prepared, Job]:
    """Take a place in the queue (429 at once when full), prepare the request on the side pool
    (its checks and limits, its schema's grammar), then queue its generation in that place."""
    state = request.app.state
    if state.settings.embedding:
        raise APIError(501, "This server does not support completions. Start it without "
                            "`--embeddings`", code="not_supported",
                       error_type="not_supported_error")
    engine = state.host.engine()                      # 503 while loading
    try:
        reservation = state.queue.reserve()
    except (QueueFull, QueueClosed) as exc:
        raise queue_refusal(state, exc) from exc
    with reservation:                                 # given back unless the job takes it
        try:
            prep = await state.side_work.run(lambda: prepare(engine), queued=True)
        except APIError:
            raise
        except Exception as exc:  # noqa: BLE001 - tokenizer/template trouble is answered
            raise engine_failure(exc) from exc
        try:
            job = state.queue.submit(generation(engine, prep, state.metrics,
                                                 getattr(state, "llamacpp", None),
                                                 record_for(request)), reservation)
        except (QueueFull, QueueClosed) as exc:
            raise queue_refusal(state, exc) from exc
    return prep, job


async def run_queued(request: Request, action: Callable[[], Any]) -> Any:
    """``action()`` as one job of the generation queue, in turn with the generations (a slot's
    save, restore or erase waits there for its slot, holding no other thread); its result,
    or 429 when the queue is full."""
    state = request.app.state

    def work(_cancel: threading.Event) -> Iterator[Any]:
        yield action()
    try:
        job = state.queue.submit(work)
    except (QueueFull, QueueClosed) as exc:
        raise queue_refusal(state, exc) from exc
    results = [result async for result in job]
    if not results:                   # cancelled before it ran: the server is stopping
        raise APIError(503, "The server is shutting down.", code="server_shutdown")
    return results[0]


async def run_pooling(state: Any, sequences: list[list[int]], score: Callable[[list[int]], Any],
                      param: str) -> list[Any]:
    """``score(ids)`` for each token sequence (an embedding, a rank), in order, as one job of
    the generation queue (the engine holds one sequence at a time), each timed into
    llama-server's metrics. 429 / 503 when the queue cannot take it or is stopping; a bad input
    a 400 naming ``param``; the engine's failures as ``engine_failure`` says."""
    def work(_cancel: threading.Event) -> Iterator[Any]:
        for ids in sequences:
            t0 = time.perf_counter()
            result = score(ids)
            state.llamacpp.observe(Timings(len(ids), time.perf_counter() - t0, 0, 0.0),
                                   len(ids))
            yield result
    try:
        job = state.queue.submit(work)
    except (QueueFull, QueueClosed) as exc:
        raise queue_refusal(state, exc) from exc
    try:
        results = [result async for result in job]
    except (ModelFileChanged, NonFiniteLogits) as exc:    # the server's fault, not the input's
        raise engine_failure(exc) from exc
    except UserError as exc:
        raise APIError(400, str(exc), code="invalid_value", param=param) from exc
    if len(results) < len(sequences):                     # cancelled: the server is stopping
        raise APIError(503, "The server is shutting down.", code="server_shutdown")
    return results


async def collect(request: Request, job: Job, prep: Prepared) -> list[shapes.ChoiceResult]:
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
        raise engine_failure(error) from error
    if prep.n and any(r.finish_reason in (None, CANCELLED) for r in results):
        # cut short: the client left (nobody reads this) or the server is stopping
        raise APIError(503, "The server is shutting down; the answer was cut short.",
                       code="server_shutdown")
    return results


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
        raise engine_failure(exc) from exc
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
