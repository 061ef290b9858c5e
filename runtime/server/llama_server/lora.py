"""llama-server's LoRA routes: ``GET /lora-adapters`` lists the adapters loaded with ``--lora``
/ ``--lora-scaled`` (``[{"id", "path", "scale", "task_name", "prompt_prefix"}]``; ``[]``
without any) and ``POST /lora-adapters`` sets their global scales (``[{"id", "scale"}]``; the
adapters not named go to 0, as llama-server). The change runs as a job of the generation
queue, so a running answer keeps the scales it started with. A request's own ``"lora"`` field
(completions, chat) wins over the global scales for that request (runtime/engine/lora.py).
"""
from __future__ import annotations

import json
from typing import Any

from fastapi import APIRouter, Request

from runtime.server.errors import APIError
from runtime.server.jobs import run_queued
from runtime.server.requests import checked_lora

router = APIRouter()


def _adapters(request: Request) -> Any:
    return getattr(request.app.state.host.engine(), "lora", None)


@router.get("/lora-adapters")
async def list_adapters(request: Request) -> list[dict]:
    adapters = _adapters(request)
    return [] if adapters is None else adapters.listing()


@router.post("/lora-adapters")
async def set_adapters(request: Request) -> dict:
    try:
        body = json.loads(await request.body() or b"null")
    except (ValueError, RecursionError) as exc:
        raise APIError(400, f"We could not parse the JSON body of your request ({exc}).",
                       code="invalid_json") from exc
    if not isinstance(body, list):
        raise APIError(400, "Request body must be an array", code="invalid_value")
    engine = request.app.state.host.engine()
    scales = checked_lora(engine, body)
    adapters = getattr(engine, "lora", None)
    if adapters is not None:
        await run_queued(request, lambda: adapters.set_global(scales or {}))
    return {"success": True}
