"""llama-server's slot actions: ``POST /slots/{id}?action=save|restore|erase`` (files under
``--slot-save-path``; runtime/engine/slot_state.py does the work). Without the flag these are
501, as llama-server answers.

An action is a job of the generation queue (jobs.run_queued), as a task of llama-server's
queue: it waits there for its slot in turn with the generations, holds no thread of the
event loop's pool meanwhile, and is a 429 when the queue is full (45 saves on a busy slot
once held every pooled thread, and every route that needs one timed out)."""
from __future__ import annotations

from fastapi import APIRouter, Request

from runtime.engine import slot_state
from runtime.errors import UserError
from runtime.server.errors import APIError
from runtime.server.jobs import run_queued
from runtime.server.requests import json_object

router = APIRouter()


def _filename(body: dict) -> str:
    name = body.get("filename")
    if not isinstance(name, str) or not name or name in (".", "..") or name != name.strip() \
            or any(c in name for c in "/\\") or any(ord(c) < 32 for c in name) \
            or len(name.encode()) > 255:
        raise APIError(400, "Invalid filename", code="invalid_value", param="filename")
    return name


@router.post("/slots/{id_slot}")
async def slot_action(id_slot: str, request: Request, action: str = "") -> dict:

    state = request.app.state
    root = state.settings.slot_save_path
    if root is None:
        raise APIError(501, "This server does not support slots action. Start it with "
                            "`--slot-save-path`", code="not_supported",
                       error_type="not_supported_error")
    try:
        seq = int(id_slot)
    except ValueError:
        raise APIError(400, "Invalid slot ID", code="invalid_value", param="id_slot") from None
    if action not in ("save", "restore", "erase"):
        raise APIError(400, "Invalid action", code="invalid_value", param="action")
    engine = state.host.engine()
    body = await json_object(request) if action != "erase" else {}
    try:
        if action == "erase":
            n = await run_queued(request, lambda: slot_state.erase(engine, seq))
            return {"id_slot": seq, "n_erased": n}
        name = _filename(body)
        path = str(root / name)
        if action == "save":
            done = await run_queued(request, lambda: slot_state.save(engine, seq, path))
            return {"id_slot": seq, "filename": name, "n_saved": done.n_tokens,
                    "n_written": done.n_bytes, "timings": {"save_ms": done.seconds * 1e3}}
        if not (root / name).is_file():
            raise APIError(400, f"{name}: no such slot file", code="invalid_value",
                           param="filename")
        done = await run_queued(request, lambda: slot_state.restore(engine, seq, path))
        return {"id_slot": seq, "filename": name, "n_restored": done.n_tokens,
                "n_read": done.n_bytes, "timings": {"restore_ms": done.seconds * 1e3}}
    except UserError as exc:
        raise APIError(400, str(exc), code="invalid_value") from exc
