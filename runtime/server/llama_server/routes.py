"""llama-server's own routes and shapes, for clients of a single-model llama-server:
``/completion`` (and ``/completions``, its alias there), ``/tokenize``, ``/detokenize``,
``/apply-template``, ``/props``, ``/slots``, ``/infill``.

Shapes follow llama.cpp's tools/server (server-task.cpp ``to_json_non_oaicompat``): a stream
is ``data: {...}`` events whose last has ``"stop": true`` (no ``[DONE]``); errors on these
routes are llama-server's ``{"error": {"code": STATUS, "message", "type"}}``. Generation goes
through the same queue and engine as the OpenAI routes; ``-np N`` gives N slots (continuous
batching, runtime/engine/batched.py).
"""
from __future__ import annotations

import asyncio
import json
import math
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from sse_starlette import EventSourceResponse

from runtime.engine.context_shift import truncate_prompt
from runtime.engine.types import CANCELLED
from runtime.server import shapes, structured
from runtime.server.errors import APIError, llama_error, register_route_shape
from runtime.server.images import MEDIA_MARKER, media_prompt
from runtime.server.jobs import collect, engine_failure, side_work, submit
from runtime.server.limits import (Limits, check_detokenize, check_prompt_tokens, check_request,
                                   check_tokenize)
from runtime.server.llama_server.schemas import NativeCompletionRequest, TokenizeRequest
from runtime.server.schemas import ChatCompletionRequest
from runtime.server.requests import (Prepared, check_context, checked_grammar, checked_lora,
                                     checked_slot, json_object, render_prompt, sampling_params,
                                     template_variables)
from runtime.server.stream_sessions import resumable
from runtime.server.token_ids import checked_ids, engine_vocab

router = APIRouter()

LLAMA_PATHS = frozenset({"/completion", "/completions", "/tokenize", "/detokenize",
                         "/apply-template", "/props", "/slots", "/infill", "/embedding"})
register_route_shape("llama", LLAMA_PATHS, prefixes=("/slots/",))   # llama-server's shape


def _stop_type(finish: str | None, stopping_word: str) -> str:
    if finish == "length":
        return "limit"
    if finish == "stop":
        return "word" if stopping_word else "eos"
    return "none"


def _probs(lp: Any, post_sampling: bool = False) -> dict:
    """One entry of ``completion_probabilities``: logprobs of the model, or probabilities
    after the sampler chain (``post_sampling_probs``)."""
    def entry(token: int, piece: bytes, logprob: float) -> dict:
        value = {"prob": math.exp(logprob)} if post_sampling else {"logprob": logprob}
        return {"id": token, "token": piece.decode("utf-8", errors="ignore"),
                "bytes": list(piece)} | value
    return entry(lp.token, lp.piece, lp.logprob) | {
        "top_probs" if post_sampling else "top_logprobs": [entry(*t) for t in lp.top]}


def generation_settings(request: Request, prep: Prepared | None, n_ctx: int) -> dict:
    p = prep.params if prep is not None else request.app.state.defaults
    return {"n_ctx": n_ctx, "seed": p.seed, "temperature": p.temperature, "top_k": p.top_k,
            "top_p": p.top_p, "min_p": p.min_p, "repeat_penalty": p.repeat_penalty,
            "presence_penalty": p.presence_penalty, "frequency_penalty": p.frequency_penalty,
            "repeat_last_n": 64, "n_predict": p.max_tokens, "max_tokens": p.max_tokens,
            "stop": list(p.stop), "n_probs": p.logprobs or 0, "stream": False,
            "grammar": p.grammar or "", "ignore_eos": False, "n_keep": p.n_keep,
            # llama-server's form; a ban (-100 here) is its -inf, null in JSON
            "logit_bias": [{"token": t, "bias": None if b <= -100 else b}
                           for t, b in p.logit_bias.items()],
            "samplers": ["penalties", "top_k", "top_p", "min_p", "temperature"],
            "lora": [{"id": i, "scale": v} for i, v in sorted((p.lora or {}).items())],
            "adaptive_target": 0.0, "adaptive_decay": 0.0}


def _prepare(engine: Any, req: NativeCompletionRequest, defaults: Any,
             limits: Limits | None = None) -> Prepared:
    if limits is not None:               # grammars and schemas, before any is converted
        check_request(req, limits)
    prompt = req.prompt_tokens_or_text(engine)
    images = req.images(engine)
    if isinstance(prompt, list):
        check_prompt_tokens(len(prompt), limits, "prompt")
        prompt = checked_ids(prompt, engine_vocab(engine), "prompt")
    if images:
        prompt = media_prompt(engine, prompt, images, "prompt")
        tokens = prompt.tokens
    else:
        tokens = prompt if isinstance(prompt, list) else engine.tokenize(prompt,
                                                                         add_special=True)
    n_prompt = len(tokens)
    # (a prompt with images is not cut: an image is evaluated whole or not at all)
    truncated = n_prompt >= engine.n_ctx and engine.settings.context_shift and not images
    if truncated:       # as llama-server: --context-shift cuts a prompt that does not fit
        prompt = truncate_prompt(tokens, engine.n_ctx, req.n_keep or 0)
        n_prompt = len(prompt)
    n_predict = req.n_predict_value()
    if n_predict is None or n_predict < 0:      # the server's -n, as llama-server: a
        n_predict = defaults.max_tokens if defaults.max_tokens > 0 else None   # default only
    # None: up to the end of the context (-1)
    max_tokens = check_context(engine, n_prompt, n_predict if n_predict else None,
                               None, "prompt", limits) if n_predict != 0 else 0
    grammar = structured.grammar_for_output(None, req.json_schema, req.grammar)
    fields = req.as_fields(defaults, engine.eog_tokens(),
                           lambda text: engine.tokenize(text, add_special=False))
    checked_ids(fields.bias, engine_vocab(engine), "logit_bias")
    params = sampling_params(fields, max(max_tokens, 1),
                             logprobs=req.n_probs or None,
                             post_sampling=req.post_sampling_probs, n_keep=req.n_keep or 0,
                             grammar=checked_grammar(engine, grammar, "grammar"))
    params.lora = checked_lora(engine, req.lora)
    return Prepared(prompt, n_prompt, params, n=0 if max_tokens == 0 else 1,
                    progress=req.return_progress, cache_prompt=req.cache_prompt is not False,
                    id_slot=checked_slot(engine, req.id_slot), truncated=truncated)


@router.post("/completion")
@router.post("/completions")
async def completion(body: NativeCompletionRequest, request: Request):
    """llama-server's native completion, streamed or not; several prompts give a list."""
    prompts = body.prompts()
    if prompts is None:
        return await _answer(body, request)
    if body.stream:
        raise APIError(400, "prompt: several prompts cannot be streamed here (send one per "
                            "request)", code="unsupported_parameter", param="prompt")
    answers = await asyncio.gather(*[
        _answer(body.model_copy(update={"prompt": p}), request, index=i)
        for i, p in enumerate(prompts)])       # side by side: one batch with -np N
    return JSONResponse([json.loads(a.body) for a in answers])


def pick_fields(answer: dict, fields: list[str]) -> dict:
    """``response_fields``: only these keys of the answer, "a/b" reaching into "a" (a missing
    one is left out, as llama-server does)."""
    out = {}
    for name in fields:
        value: Any = answer
        for key in name.split("/"):
            if not isinstance(value, dict) or key not in value:
                break
            value = value[key]
        else:
            out[name] = value
    return out


async def _answer(body: NativeCompletionRequest, request: Request, index: int = 0):
    defaults, limits = request.app.state.defaults, request.app.state.settings.limits
    prep, job = await submit(request, lambda e: _prepare(e, body, defaults, limits))
    engine = request.app.state.host.engine()
    model = request.app.state.host.model_id
    prompt_text = prep.prompt if isinstance(prep.prompt, str) else \
        getattr(prep.prompt, "text", None) or engine.detokenize(prep.prompt)
    settings = generation_settings(request, prep, engine.n_ctx) | {"stream": body.stream}

    def final(text: str, tokens: list[int], finish: str | None, timings: Any, n: int,
              probs: list | None) -> dict:
        out = {"index": index, "content": text, "tokens": tokens if body.return_tokens else [],
               "id_slot": max(prep.id_slot, 0), "stop": True, "model": model, "tokens_predicted": n,
               "tokens_evaluated": prep.prompt_tokens, "generation_settings": settings,
               "prompt": prompt_text, "has_new_line": "\n" in text,
               # the context filled up before the answer ended
               "truncated": prep.truncated or (finish == "length" and
                                               prep.prompt_tokens + n >= engine.n_ctx),
               "stop_type": _stop_type(finish, ""), "stopping_word": "",
               "tokens_cached": prep.prompt_tokens + n, "timings": shapes.llama_timings(timings,
                                                                       prep.prompt_tokens)}
        if probs:
            out["completion_probabilities"] = probs
        return out

    if body.stream:
        async def events():
            n, timings, finish, all_text = 0, None, None, []
            clock = shapes.RunningTimings(prep.prompt_tokens)
            try:
                async for _, chunk in job:
                    if chunk.progress is not None:
                        clock.prompt = chunk.progress
                        event = {"index": index, "content": "", "tokens": [], "stop": False,
                                 "id_slot": max(prep.id_slot, 0), "tokens_predicted": 0,
                                 "tokens_evaluated": prep.prompt_tokens,
                                 "prompt_progress": shapes.prompt_progress(chunk.progress)}
                        if body.timings_per_token:
                            event["timings"] = shapes.progress_timings(chunk.progress)
                        yield json.dumps(event)
                    elif chunk.token is not None:
                        n += 1
                        event = {"index": index, "content": chunk.text, "tokens": [chunk.token],
                                 "stop": False, "id_slot": max(prep.id_slot, 0),
                                 "tokens_predicted": n, "tokens_evaluated": prep.prompt_tokens}
                        if body.timings_per_token:
                            event["timings"] = clock.now(n)
                        if chunk.logprob is not None:
                            event["completion_probabilities"] = [
                                _probs(chunk.logprob, body.post_sampling_probs)]
                        all_text.append(chunk.text)
                        yield json.dumps(event)
                    elif chunk.text:
                        all_text.append(chunk.text)
                        yield json.dumps({"index": index, "content": chunk.text, "tokens": [],
                                          "stop": False, "id_slot": max(prep.id_slot, 0),
                                          "tokens_predicted": n,
                                          "tokens_evaluated": prep.prompt_tokens})
                    if chunk.finish_reason is not None:
                        finish, timings = chunk.finish_reason, chunk.timings
                if finish in (None, CANCELLED):
                    yield json.dumps(llama_error(APIError(503, "The server is shutting down.",
                                                          code="server_shutdown")))
                    return
                last = final("", [], finish, timings, n, None)
                yield json.dumps(last)
            except Exception as exc:  # noqa: BLE001 - in-band, as llama-server does
                yield json.dumps(llama_error(engine_failure(exc)))
            finally:
                job.cancel.set()
        payloads = events()
        return resumable(request, payloads) or EventSourceResponse(payloads)

    results = await collect(request, job, prep)
    r = results[0]
    tokens = [lp.token for lp in r.logprobs]
    answer = final(r.text, tokens or r.tokens, r.finish_reason, r.timings, r.completion_tokens,
                   [_probs(lp, body.post_sampling_probs) for lp in r.logprobs]
                   if body.n_probs else None)
    return JSONResponse(pick_fields(answer, body.response_fields) if body.response_fields
                        else answer)


@router.post("/tokenize")
async def tokenize(body: TokenizeRequest, request: Request) -> JSONResponse:
    """Token ids (with their pieces) of ``content``, up to ``--max-tokenize-kib`` of it; the
    work and its JSON on the side pool (a long text with pieces takes seconds)."""
    engine = request.app.state.host.engine()
    check_tokenize(body.content, request.app.state.settings.limits)

    def work() -> JSONResponse:
        tokens = engine.tokenize(body.content, add_special=body.add_special)
        if not body.with_pieces:
            return JSONResponse({"tokens": tokens})
        out = []
        for t in tokens:
            piece = engine.token_bytes(t, special=True)
            try:
                shown: Any = piece.decode("utf-8")
            except UnicodeDecodeError:
                shown = list(piece)            # llama-server: bytes when not valid UTF-8
            out.append({"id": t, "piece": shown})
        return JSONResponse({"tokens": out})
    return await side_work(request, work)


@router.post("/detokenize")
async def detokenize(request: Request) -> JSONResponse:
    """The text of up to ``--max-detokenize-tokens`` ids, on the side pool."""
    body = await json_object(request)
    tokens = body.get("tokens", [])
    engine = request.app.state.host.engine()
    if not isinstance(tokens, list):
        raise APIError(400, "tokens: must be a list of token ids", code="invalid_value",
                       param="tokens")
    check_detokenize(tokens, request.app.state.settings.limits)
    ids = checked_ids(tokens, engine_vocab(engine), "tokens")
    return await side_work(request, lambda: JSONResponse({"content": engine.detokenize(ids)}))


@router.post("/apply-template")
async def apply_template(request: Request) -> dict:

    body = await json_object(request)
    add = body.get("add_generation_prompt")
    if add is not None and not isinstance(add, bool):
        raise APIError(400, "add_generation_prompt: must be true or false",
                       code="invalid_value", param="add_generation_prompt")
    req = ChatCompletionRequest.model_validate({"messages": body.get("messages"),
                                                "tools": body.get("tools"),
                                                "chat_template_kwargs":
                                                    body.get("chat_template_kwargs"),
                                                "add_generation_prompt": add})
    engine = request.app.state.host.engine()
    template = engine.chat_template
    messages = structured.history_messages(
        req.message_dicts(), structured.tool_format(template.source),
        template_tools=structured.template_knows_tools(template.source), tools=req.tool_dicts())
    tools = req.tool_dicts() if structured.template_knows_tools(template.source) else None
    variables = template_variables(request.app.state.settings.reasoning,
                                   req.template_kwargs())
    # as the chat path renders it (a last assistant message is a prefill); on the side pool:
    # a long chat takes a while to render
    return {"prompt": await side_work(request, lambda: render_prompt(
        engine, messages, tools=tools, add_generation_prompt=add, variables=variables))}


@router.get("/props")
async def props(request: Request) -> dict:
    """The model's properties; while it sleeps, those it had as it fell asleep (lifecycle.py),
    with ``is_sleeping: true``: reading them does not wake it."""
    snapshot = request.app.state.lifecycle.snapshot
    if snapshot is not None and request.app.state.lifecycle.sleeping:
        return snapshot.props | {"is_sleeping": True}
    return props_payload(request)


def props_payload(request: Request) -> dict:
    """``GET /props`` of the loaded model (503 while it loads)."""
    host = request.app.state.host
    engine = host.engine()
    template = engine.chat_template
    return {"default_generation_settings": {
                "n_ctx": engine.n_ctx, "params": generation_settings(request, None, engine.n_ctx)},
            "total_slots": engine.settings.n_parallel, "model_alias": host.model_id,
            "model_path": engine.settings.model_path, "chat_template": template.source,
            "bos_token": template.bos_token, "eos_token": template.eos_token,
            "modalities": {"vision": bool(engine.projector and engine.projector.vision),
                           "video": False, "audio": False},
            "media_marker": MEDIA_MARKER,
            "build_info": request.app.state.fingerprint, "is_sleeping": False}


@router.get("/slots")
async def slots(request: Request):
    if not request.app.state.settings.slots_endpoint:
        raise APIError(501, "This server does not support slots endpoint (start it with "
                            "--slots).", code="not_supported", error_type="not_supported_error")
    engine = request.app.state.host.engine()
    running = request.app.state.queue.stats().running
    # llama-server: ?fail_on_no_slot (any value) turns "every slot is busy" into a 503
    if "fail_on_no_slot" in request.query_params and running >= engine.settings.n_parallel:
        raise APIError(503, "no slot available", code="unavailable",
                       error_type="unavailable_error")
    return [{"id": i, "id_task": -1, "n_ctx": engine.n_ctx, "speculative": False,
             "is_processing": i < running, "next_token": [{"has_next_token": True,
             "has_new_line": False, "n_remain": -1, "n_decoded": 0}]}
            for i in range(engine.settings.n_parallel)]


@router.post("/infill")
async def infill(request: Request):
    """Fill in the middle: ``input_prefix`` + ``input_suffix`` (+ ``prompt``, the start of the
    middle) in the model's FIM tokens, then a native completion. 400 without FIM tokens."""
    body = await json_object(request)
    engine = request.app.state.host.engine()
    fim = engine.fim_tokens()
    if fim is None:
        raise APIError(400, "This model has no fill-in-the-middle tokens (FIM prefix, suffix "
                            "and middle), so /infill cannot work with it.", code="invalid_value")
    parts = {}
    for name in ("input_prefix", "input_suffix", "prompt"):
        value = body.pop(name, "")
        if not isinstance(value, str):
            raise APIError(400, f"{name}: must be a string", code="invalid_value", param=name)
        parts[name] = value
    if body.pop("input_extra", None):
        raise APIError(400, "input_extra: extra context chunks are not supported",
                       code="unsupported_parameter", param="input_extra")
    pre, suf, mid = fim
    tok = lambda text: engine.tokenize(text, add_special=False) if text else []  # noqa: E731
    tokens = [pre, *tok(parts["input_prefix"]), suf, *tok(parts["input_suffix"]), mid,
              *tok(parts["prompt"])]
    native = NativeCompletionRequest.model_validate(body | {"prompt": tokens})
    return await _answer(native, request)
