"""ASGI middleware: a request body is bounded in size and is JSON the rest of the server can
hold, before any route parses it.

- Over ``Limits.max_body_bytes`` (by ``Content-Length`` or as it arrives): 400
  ``limit_exceeded`` naming the limit and its flag, without reading the rest (a 400 like
  every other limit's, so a client handles one kind of refusal).
- A JSON body holding a lone UTF-16 surrogate (``"a\\ud800b"``: Python's JSON parser lets it
  through, UTF-8 cannot encode it) or a non-finite number (``1e999``, ``NaN``, ``Infinity``:
  JSON has none, and an answer that echoes one cannot be written): 400 naming the field.

Errors take the shape of the route's API (errors.route_response). A body that is not JSON
goes on as it is: the route answers that in its own words (``/cors-proxy`` forwards bodies).
"""
from __future__ import annotations

import json
import math
import re
from typing import Any

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from runtime.server.errors import APIError, route_response
from runtime.server.limits import Limits

_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")
RAW_BODY_PATHS = frozenset({"/cors-proxy"})       # bodies passed on, not parsed here


class _NonFinite(float):
    """A float the parser met that JSON cannot hold (kept to find its path)."""


def _parse_float(text: str) -> float:
    value = float(text)
    return value if math.isfinite(value) else _NonFinite(value)


def _first_bad(data: Any) -> tuple[str, str] | None:
    """(path, reason) of the first lone surrogate or non-finite number in ``data``."""
    stack: list[tuple[str, Any]] = [("", data)]
    while stack:
        path, node = stack.pop()
        if isinstance(node, _NonFinite):
            return path, "is not a finite number (JSON has no infinity or NaN)"
        if isinstance(node, str):
            try:
                node.encode("utf-8")
            except UnicodeEncodeError as exc:
                return path, (f"holds a lone UTF-16 surrogate (\\u{ord(node[exc.start]):04x} "
                              f"at character {exc.start}), which is not valid Unicode")
        elif isinstance(node, dict):
            for key, value in node.items():
                sub = f"{path}.{key}" if path else str(key)
                if _first_bad(key) is not None:
                    return (path or "body"), f"has a key that {_first_bad(key)[1]}"
                stack.append((sub, value))
        elif isinstance(node, list):
            stack.extend((f"{path}.{i}" if path else str(i), v) for i, v in enumerate(node))
    return None


def check_json_body(body: bytes) -> APIError | None:
    """The 400 for a JSON body that holds a value the server cannot take, else None (also
    for a body that is not JSON at all: the route answers that)."""
    try:
        data = json.loads(body, parse_float=_parse_float,
                          parse_constant=lambda name: _NonFinite(float(name)))
    except RecursionError:
        return APIError(400, "The JSON body is nested too deeply.", code="invalid_json")
    except ValueError:
        return None
    bad = _first_bad(data)
    if bad is None:
        return None
    path, reason = bad
    return APIError(400, f"{path or 'body'}: {reason}", code="invalid_value",
                    param=path or None)


class BodyGuard:
    def __init__(self, app: ASGIApp, limits: Limits) -> None:
        self.app, self.limits = app, limits

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] not in ("POST", "PUT", "PATCH"):
            await self.app(scope, receive, send)
            return
        path, limit = scope.get("path", ""), self.limits.max_body_bytes
        too_big = APIError(400, f"request body: over this server's limit of {limit} bytes "
                                "(request body size, --max-body-mib)", code="limit_exceeded")
        declared = Headers(scope=scope).get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            await route_response(path, too_big)(scope, receive, send)
            return
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":        # the client left mid-body:
                return                                    # nobody to answer (counted 499)
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                await route_response(path, too_big)(scope, receive, send)
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        if path not in RAW_BODY_PATHS:
            # the full parse only when the text could hold what it looks for
            suspect = _SURROGATE_ESCAPE.search(body) or re.search(
                rb"[eE][+]?\d{3}|\d{300}|NaN|Infinity", body)
            error = check_json_body(body) if suspect else None
            if error is not None:
                await route_response(path, error)(scope, receive, send)
                return
        await self.app(scope, _replay([{"type": "http.request", "body": body,
                                        "more_body": False}], receive), send)


def _replay(messages: list[Message], receive: Receive) -> Receive:
    """A receive that gives ``messages`` first, then the client's own."""
    pending = list(messages)

    async def replay() -> Message:
        if pending:
            return pending.pop(0)
        return await receive()
    return replay
