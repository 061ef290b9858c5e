"""Vertex AI's prediction route, as llama-server serves it (tools/server/server-http.cpp,
``register_gcp_compat``): on when the environment says ``AIP_MODE=PREDICTION`` (Vertex AI's
custom-container variables). ``POST $AIP_PREDICT_ROUTE`` (``/predict``) takes
``{"instances": [...]}``; each instance names a route in ``@requestFormat``, as its path
(``/v1/chat/completions``) or llama-server's camelCase alias of it (``chatCompletions``), and
carries that route's body. The instances run side by side, never streamed; the answer is
``{"predictions": [...]}``, one body (or error object) per instance, in order.
``AIP_HEALTH_ROUTE`` adds a second path for the health check.
"""
from __future__ import annotations

import asyncio
import json
import os
import re
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute

from runtime.server.errors import APIError, error_body

MAX_INSTANCES = 128              # llama-server's bound


def enabled() -> bool:
    return os.environ.get("AIP_MODE", "") == "PREDICTION"


def gcp_format(path: str) -> str:
    """llama-server's camelCase alias of a route: /v1/chat/completions -> chatCompletions."""
    path = path.removeprefix("/v1").lstrip("/").split("{")[0]
    return re.sub(r"[/_-]+(.)", lambda m: m.group(1).upper(), path).rstrip("/_-")


def install(app: FastAPI) -> None:
    """Add the predict (and health) routes when ``AIP_MODE=PREDICTION``."""
    if not enabled():
        return
    routes = list(_api_routes(app.routes))
    posts = [r.path for r in routes if "POST" in r.methods]
    aliases: dict[str, str] = {}
    for path in posts:                      # the first registration wins, as llama-server
        aliases.setdefault(gcp_format(path), path)
    health = os.environ.get("AIP_HEALTH_ROUTE", "")
    if health:
        app.add_api_route(health, next(r.endpoint for r in routes if r.path == "/health"),
                          methods=["GET"], include_in_schema=False)

    async def predict(request: Request) -> JSONResponse:
        try:
            data = json.loads(await request.body())
        except ValueError as exc:
            raise APIError(400, f"We could not parse the JSON body ({exc}).",
                           code="invalid_json") from exc
        if not isinstance(data, dict) or not isinstance(data.get("instances"), list):
            raise APIError(400, "request body must include an array field named instances",
                           code="invalid_value", param="instances")
        instances = data["instances"]
        if len(instances) > MAX_INSTANCES:
            raise APIError(400, f"instances array exceeds maximum size of {MAX_INSTANCES}",
                           code="invalid_value", param="instances")
        headers = {k: v for k, v in request.headers.items()
                   if k.lower() in ("authorization", "x-api-key")}
        transport = httpx.ASGITransport(app=request.app)
        async with httpx.AsyncClient(transport=transport, base_url="http://predict",
                                     timeout=None) as client:
            answers = await asyncio.gather(*[_one(client, headers, aliases, posts, i)
                                             for i in instances])
        return JSONResponse({"predictions": answers})

    app.add_api_route(os.environ.get("AIP_PREDICT_ROUTE", "/predict"), predict,
                      methods=["POST"], include_in_schema=False)


def _api_routes(routes):
    """Every APIRoute, inside included routers too (FastAPI keeps those whole)."""
    for route in routes:
        if isinstance(route, APIRoute):
            yield route
        elif hasattr(route, "original_router"):
            yield from _api_routes(route.original_router.routes)


def _invalid(message: str) -> dict:
    return error_body(message, "invalid_request_error", "invalid_value")


async def _one(client: httpx.AsyncClient, headers: dict, aliases: dict[str, str],
               posts: list[str], instance: Any) -> Any:
    if not isinstance(instance, dict):
        return _invalid("each instance must be a JSON object")
    fmt = instance.get("@requestFormat")
    if not isinstance(fmt, str):
        return _invalid("each instance must include a string @requestFormat")
    path = aliases.get(fmt) or (fmt if fmt in posts else None)
    if path is None:
        return _invalid(f"no handler registered for @requestFormat: {fmt}")
    payload = {k: v for k, v in instance.items() if k != "@requestFormat"}
    if "stream" in payload:                 # the predict route never streams
        payload["stream"] = False
    r = await client.post(path, json=payload, headers=headers)
    try:
        return r.json()
    except ValueError:
        return r.text
