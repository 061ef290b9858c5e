"""Embeddings, as llama-server serves them with ``--embedding``: ``POST /v1/embeddings``
(OpenAI's shape; ``content`` instead of ``input`` answers llama-server's) and llama-server's
``POST /embedding`` and ``/embeddings`` (``[{"index", "embedding": [[...]]}]``, one vector per
token with pooling ``none``). Inputs: a string, token ids, or a list of them (one answer each). Without
``--embedding`` these routes are 501, and with it the generation routes are.
"""
from __future__ import annotations

import base64
import struct
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from runtime.engine.embedding import embed, pooled
from runtime.server.errors import APIError
from runtime.server.jobs import run_pooling, side_work
from runtime.server.requests import json_object
from runtime.server.token_ids import checked_ids, engine_vocab

router = APIRouter()


def _inputs(body: dict) -> tuple[list[Any], bool]:
    """(the inputs, OpenAI's shape?): ``input`` answers in OpenAI's shape, ``content`` in
    llama-server's. As llama-server: a list without numbers holds several inputs; a string,
    token ids (mixed with strings) or an object is one."""
    if "input" in body:
        value, oai = body.pop("input"), True
    elif "content" in body:
        value, oai = body.pop("content"), False
    else:
        raise APIError(400, '"input" or "content" must be provided',
                       code="missing_required_parameter", param="input")
    several = isinstance(value, list) and not any(
        isinstance(x, int) and not isinstance(x, bool) for x in value)
    items = value if several else [value]
    if not items:
        raise APIError(400, '"input" must not be empty', code="invalid_value", param="input")
    return items, oai


def _tokens(engine: Any, item: Any, i: int) -> list[int]:
    """One input's token ids: a string, ids mixed with strings, ``{"prompt_string": ...}`` or
    ``{"content": [text parts]}`` (text only: no multimodal inputs here)."""
    bad = APIError(400, f"input[{i}]: a string, token ids, {{\"prompt_string\": ...}} or "
                        '{"content": [{"type": "text", ...}]} (text only)', code="invalid_value",
                   param="input")
    if isinstance(item, dict):
        if set(item) == {"prompt_string"} and isinstance(item["prompt_string"], str):
            item = item["prompt_string"]
        elif set(item) == {"content"} and isinstance(item["content"], list) and all(
                isinstance(p, dict) and p.get("type") == "text"
                and isinstance(p.get("text"), str) for p in item["content"]):
            item = "".join(p["text"] for p in item["content"])
        else:
            raise bad
    if isinstance(item, str):
        return engine.tokenize(item, add_special=True)
    if not isinstance(item, list):
        raise bad
    tokens: list[int] = []
    for part in item:
        if isinstance(part, str):
            tokens.extend(engine.tokenize(part, add_special=not tokens))
        elif isinstance(part, int) and not isinstance(part, bool):
            tokens.append(part)
        else:
            raise bad
    return tokens


async def _embed_all(request: Request, body: dict, oai: bool | None = None):
    state = request.app.state
    if not state.settings.embedding:
        raise APIError(501, "This server does not support embeddings. Start it with "
                            "`--embeddings`", code="not_supported", error_type="not_supported_error")
    engine = state.host.engine()
    items, oai_shape = _inputs(body)
    oai = oai_shape if oai is None else oai
    fmt = body.pop("encoding_format", "float")
    if fmt not in ("float", "base64"):
        raise APIError(400, "encoding_format: the format to return the embeddings in. Can be "
                            "either float or base64", code="invalid_value", param="encoding_format")
    norm = body.pop("embd_normalize", 2)
    if isinstance(norm, bool) or not isinstance(norm, int):
        raise APIError(400, "embd_normalize: must be an integer", code="invalid_value",
                       param="embd_normalize")
    body.pop("model", None)
    if body:
        name = sorted(body)[0]
        raise APIError(400, f"{name}: this field is not supported by this server",
                       code="unsupported_parameter", param=name)
    if oai and not pooled(engine):
        raise APIError(400, "Pooling type 'none' is not OAI compatible. Please use a different "
                            "pooling type", code="invalid_value")
    tokens = await side_work(request, lambda: [     # off the event loop: a long text
        checked_ids(_tokens(engine, x, i), engine_vocab(engine), "input")   # takes a while
        for i, x in enumerate(items)])
    results = []
    for ids in tokens:                # a job each: the engine holds one sequence at a time
        (vectors,) = await run_pooling(state, [ids], lambda t: embed(engine, t, norm), "input")
        results.append((ids, vectors))
    return results, oai, fmt


def _b64(vector: list[float]) -> str:
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode()


@router.post("/v1/embeddings")
async def embeddings(request: Request) -> JSONResponse:
    """OpenAI's embeddings (``content`` instead of ``input`` answers llama-server's shape)."""

    results, oai, fmt = await _embed_all(request, await json_object(request))
    if not oai:
        return JSONResponse([{"index": i, "embedding": v} for i, (_, v) in enumerate(results)])
    n = sum(len(ids) for ids, _ in results)
    return JSONResponse({
        "object": "list", "model": request.app.state.host.model_id,
        "data": [{"object": "embedding", "index": i,
                  "embedding": _b64(v[0]) if fmt == "base64" else v[0]}
                 for i, (_, v) in enumerate(results)],
        "usage": {"prompt_tokens": n, "total_tokens": n}})


@router.post("/embedding")
@router.post("/embeddings")
async def embedding(request: Request) -> JSONResponse:
    """llama-server's native embeddings: ``[{"index", "embedding": [[...], ...]}]``."""

    results, _, _ = await _embed_all(request, await json_object(request), oai=False)
    return JSONResponse([{"index": i, "embedding": v} for i, (_, v) in enumerate(results)])
