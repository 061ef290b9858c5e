"""Embeddings, as llama-server serves them with ``--embedding``: ``POST /v1/embeddings``
(OpenAI's shape; also ``/embeddings`` with ``input``) and llama-server's ``POST /embedding``
(``content``; ``[{"index", "embedding": [[...]]}]``, one vector per token with pooling
``none``). Inputs: a string, token ids, or a list of them (one answer each). Without
``--embedding`` these routes are 501, and with it the generation routes are.
"""
from __future__ import annotations

import base64
import struct
from typing import Any

import anyio
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from runtime.engine.embedding import embed, pooled
from runtime.engine.types import Timings
from runtime.errors import UserError
from runtime.server.errors import APIError
from runtime.server.queue import QueueClosed, QueueFull

router = APIRouter()


def _inputs(body: dict) -> tuple[list[Any], bool]:
    """(the inputs, OpenAI's shape?): ``input`` answers in OpenAI's shape, ``content`` in
    llama-server's."""
    if "input" in body:
        value, oai = body.pop("input"), True
    elif "content" in body:
        value, oai = body.pop("content"), False
    else:
        raise APIError(400, '"input" or "content" must be provided', code="missing_required_parameter",
                       param="input")
    is_ids = isinstance(value, list) and value and all(isinstance(x, int) for x in value)
    items = value if isinstance(value, list) and not is_ids else [value]
    if not items:
        raise APIError(400, '"input" must not be empty', code="invalid_value", param="input")
    for i, item in enumerate(items):
        ok = isinstance(item, str) or (isinstance(item, list) and all(
            isinstance(t, int) and not isinstance(t, bool) for t in item))
        if not ok:
            raise APIError(400, f"input[{i}]: must be a string or a list of token ids",
                           code="invalid_value", param="input")
    return items, oai


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
    tokens = [engine.tokenize(x, add_special=True) if isinstance(x, str) else list(x)
              for x in items]
    if any(not 0 <= t < engine.n_vocab for ids in tokens for t in ids):
        raise APIError(400, f"input: token ids must be in [0, {engine.n_vocab})",
                       code="invalid_value", param="input")
    results = []
    for ids in tokens:                # one after another: the engine holds one sequence
        def work(_cancel, ids=ids):
            import time  # noqa: PLC0415

            t0 = time.perf_counter()
            vectors = embed(engine, ids, norm)
            state.llamacpp.observe(Timings(len(ids), time.perf_counter() - t0, 0, 0.0),
                                   len(ids))
            yield vectors
        try:
            job = state.queue.submit(work)
        except (QueueFull, QueueClosed) as exc:
            raise APIError(429 if isinstance(exc, QueueFull) else 503, str(exc),
                           code="queue_full" if isinstance(exc, QueueFull) else
                           "server_shutdown") from exc
        try:
            async for vectors in job:
                results.append((ids, vectors))
        except UserError as exc:
            raise APIError(400, str(exc), code="invalid_value", param="input") from exc
    return results, oai, fmt


def _b64(vector: list[float]) -> str:
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode()


@router.post("/v1/embeddings")
@router.post("/embeddings")
async def embeddings(request: Request) -> JSONResponse:
    """OpenAI's embeddings (``content`` instead of ``input`` answers llama-server's shape)."""
    from runtime.server.native import _json_object  # noqa: PLC0415

    results, oai, fmt = await _embed_all(request, await _json_object(request))
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
async def embedding(request: Request) -> JSONResponse:
    """llama-server's native embeddings: ``[{"index", "embedding": [[...], ...]}]``."""
    from runtime.server.native import _json_object  # noqa: PLC0415

    results, _, _ = await _embed_all(request, await _json_object(request), oai=False)
    return JSONResponse([{"index": i, "embedding": v} for i, (_, v) in enumerate(results)])
