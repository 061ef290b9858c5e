"""ASGI middleware: a request body is bounded in size and is JSON the rest of the server can
hold, before any route parses it.

- Over ``Limits.max_body_bytes`` (by ``Content-Length`` or as it arrives): 400
  ``limit_exceeded`` naming the limit and its flag, without reading the rest (a 400 like
  every other limit's, so a client handles one kind of refusal).
- A JSON body that is not UTF-8: 400 naming the first bad byte (the parser's own error was a
  bare "There was an error parsing the body").
- A JSON body nested deeper than ``Limits.max_json_depth``: 400, found by counting brackets
  outside strings before anything parses it (Python's parser recurses once per level: 100k
  levels were a RecursionError, a 500, on every route that reads its body itself).
- A JSON body holding a lone UTF-16 surrogate (``"a\\ud800b"``: Python's JSON parser lets it
  through, UTF-8 cannot encode it), a non-finite number (``1e999``, ``NaN``, ``Infinity``:
  JSON has none, and an answer that echoes one cannot be written) or an integer outside 64
  bits (-2**63 .. 2**64-1, what llama-server's parser holds; a 400-digit one was an
  OverflowError, a schema bound past it a grammar that ignored it): 400 naming the field.

Errors take the shape of the route's API (errors.route_response). A body that is not JSON
goes on as it is: the route answers that in its own words (``/cors-proxy`` forwards bodies).
"""
from __future__ import annotations

import json
import math
import re
from typing import Any

import numpy as np

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from runtime.server.errors import APIError, route_response
from runtime.server.limits import Limits

_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")
# what could hold a number JSON or 64 bits cannot: an exponent of 3 digits, 19+ digits
_BIG_NUMBER = re.compile(rb"[eE][+]?\d{3}|\d{19}|NaN|Infinity")
_JSON_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.S)
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")
INT64_RANGE = (-(1 << 63), (1 << 64) - 1)          # signed or unsigned 64-bit
RAW_BODY_PATHS = frozenset({"/cors-proxy"})       # bodies passed on, not parsed here


class _NonFinite(float):
    """A float the parser met that JSON cannot hold (kept to find its path)."""


class _Huge:
    """An integer the parser met that 64 bits cannot hold (its text: Python refuses to
    convert one of over 4300 digits)."""

    __slots__ = ("text",)

    def __init__(self, text: str) -> None:
        self.text = text

    def shown(self) -> str:
        digits = len(self.text.lstrip("-"))
        return self.text if digits <= 24 else f"{self.text[:20]}... ({digits} digits)"


def _parse_float(text: str) -> float:
    value = float(text)
    return value if math.isfinite(value) else _NonFinite(value)


def _parse_int(text: str) -> int | _Huge:
    if len(text) > 21:            # past 2**64's 20 digits and a sign: not converted at all
        return _Huge(text)
    value = int(text)
    return value if INT64_RANGE[0] <= value <= INT64_RANGE[1] else _Huge(text)


_DEPTH_CHUNK = 1 << 20              # brackets per numpy pass (bounds the temporary arrays)


def json_depth(body: bytes, limit: int) -> int:
    """How deep ``body``'s arrays and objects nest (brackets inside strings are text), or 0
    when it has too few brackets to nest past ``limit``; a number past ``limit`` may be
    where the count stopped, not the deepest point."""
    if body.count(b"[") + body.count(b"{") <= limit:
        return 0
    brackets = _JSON_STRING.sub(b"", body).translate(None, _NOT_BRACKETS)
    depth = deepest = 0
    for start in range(0, len(brackets), _DEPTH_CHUNK):
        chunk = np.frombuffer(brackets, np.uint8, min(_DEPTH_CHUNK, len(brackets) - start),
                              start)
        steps = np.where((chunk == ord("[")) | (chunk == ord("{")), 1, -1).astype(np.int32)
        running = np.cumsum(steps, dtype=np.int64) + depth
        deepest, depth = max(deepest, int(running.max())), int(running[-1])
        if deepest > limit:
            break
    return deepest


def _first_bad(data: Any) -> tuple[str, str] | None:
    """(path, reason) of the first lone surrogate, non-finite number or integer outside 64
    bits in ``data``."""
    stack: list[tuple[str, Any]] = [("", data)]
    while stack:
        path, node = stack.pop()
        if isinstance(node, _NonFinite):
            return path, "is not a finite number (JSON has no infinity or NaN)"
        if isinstance(node, _Huge):
            return path, (f"{node.shown()} is outside the 64-bit integer range "
                          f"({INT64_RANGE[0]}..{INT64_RANGE[1]})")
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


def check_json_body(body: bytes, limits: Limits) -> APIError | None:
    """The 400 for a JSON body that the server cannot take (not UTF-8, nested too deeply, or
    holding a value it cannot hold), else None (also for a body that is not JSON at all:
    the route answers that)."""
    try:
        body.decode("utf-8")
    except UnicodeDecodeError as exc:
        if json.detect_encoding(body) == "utf-8":       # (UTF-16/32 JSON parses as it is)
            return APIError(400, f"We could not parse the JSON body of your request: it is "
                                 f"not valid UTF-8 (byte 0x{body[exc.start]:02x} at offset "
                                 f"{exc.start}).", code="invalid_json")
    depth = json_depth(body, limits.max_json_depth)
    if depth > limits.max_json_depth:
        return APIError(400, f"The JSON body nests arrays and objects {depth} deep, over this "
                             f"server's limit of {limits.max_json_depth} (--max-json-depth).",
                        code="limit_exceeded")
    # the full parse only when the text could hold what it looks for
    if not (_SURROGATE_ESCAPE.search(body) or _BIG_NUMBER.search(body)):
        return None
    try:
        data = json.loads(body, parse_float=_parse_float, parse_int=_parse_int,
                          parse_constant=lambda name: _NonFinite(float(name)))
    except (ValueError, RecursionError):
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
        if path not in RAW_BODY_PATHS and _is_json(scope):
            error = check_json_body(body, self.limits)
            if error is not None:
                await route_response(path, error)(scope, receive, send)
                return
        await self.app(scope, _replay([{"type": "http.request", "body": body,
                                        "more_body": False}], receive), send)


def _is_json(scope: Scope) -> bool:
    """The body is JSON (request_log.JsonBody has made untyped bodies JSON already)."""
    kind = Headers(scope=scope).get("content-type", "").split(";")[0].strip().lower()
    return kind == "application/json" or kind.endswith("+json")


def _replay(messages: list[Message], receive: Receive) -> Receive:
    """A receive that gives ``messages`` first, then the client's own."""
    pending = list(messages)

    async def replay() -> Message:
        if pending:
            return pending.pop(0)
        return await receive()
    return replay
