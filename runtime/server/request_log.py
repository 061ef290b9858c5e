"""llama-server's habits at the HTTP edge: one log line per request, and a JSON body taken
whatever its Content-Type says.

    moe-offload: POST /v1/chat/completions 127.0.0.1 200 | 12 prompt + 64 generated tokens, 35.2 t/s | 1.84 s
    moe-offload: GET /v1/models 127.0.0.1 200 | 0.00 s

A generation route fills its request's ``GenerationRecord`` (``record_for(request)``) from the
worker thread; the line is written when the response has been sent (a stream: at its end).
Pure ASGI middleware (not ``BaseHTTPMiddleware``): streams and disconnects pass untouched.
What a client sent (a path with ``%0d%0a`` or ``%1b``, a field quoted in an error) is logged
with its control characters escaped (``printable``, ``PrintableFormatter``): it cannot end
the line, forge another, or drive the terminal.
"""
from __future__ import annotations

import logging
import re
import time
from dataclasses import dataclass

from starlette.requests import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

log = logging.getLogger("moe_offload.server")

QUIET_PATHS = frozenset({"/health", "/v1/health"})     # pollers: no line (as llama-server)
MAX_LOGGED_PATH = 256                                   # characters of a path in a line
_STATE_KEY = "generation_record"


@dataclass
class GenerationRecord:
    """What one request generated (summed over its choices), written by the worker."""

    prompt_tokens: int = 0
    generated_tokens: int = 0
    seconds: float = 0.0            # wall time of the generation on the worker

    def add(self, prompt_tokens: int, generated_tokens: int, seconds: float) -> None:
        self.prompt_tokens += prompt_tokens
        self.generated_tokens += generated_tokens
        self.seconds += seconds


def record_for(request: Request) -> GenerationRecord:
    """The request's record (made on first use); the log line reads it at the end."""
    state = request.scope.setdefault("state", {})
    record = state.get(_STATE_KEY)
    if record is None:
        record = state[_STATE_KEY] = GenerationRecord()
    return record


# C0 and C1 controls, DEL, line/paragraph separators, bidirectional overrides
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029\u200e\u200f\u202a-\u202e"
                      "\u2066-\u2069]")


def _escaped(match: re.Match) -> str:
    code = ord(match.group())
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def printable(text: str) -> str:
    """``text`` with its control characters escaped (``\\x0a``, ``\\x1b``, ``\\u202e``)."""
    return _CONTROL.sub(_escaped, text)


class PrintableFormatter(logging.Formatter):
    """A formatter whose messages carry no control characters (a traceback below one keeps
    its lines)."""

    def formatMessage(self, record: logging.LogRecord) -> str:
        record.message = printable(record.message)
        return super().formatMessage(record)


def log_line(method: str, path: str, client: str, status: int, seconds: float,
             record: GenerationRecord | None) -> str:
    """The request's line (without the ``moe-offload:`` prefix the handler adds)."""
    if len(path) > MAX_LOGGED_PATH:      # a 16 KiB URL makes no 16 KiB line
        path = f"{path[:MAX_LOGGED_PATH]}...({len(path)} characters)"
    parts = [printable(f"{method} {path} {client} {status}".replace("  ", " "))]
    if record is not None and (record.prompt_tokens or record.generated_tokens):
        tps = record.generated_tokens / record.seconds if record.seconds > 0 else 0.0
        parts.append(f"{record.prompt_tokens} prompt + {record.generated_tokens} generated "
                     f"tokens, {tps:.1f} t/s")
    parts.append(f"{seconds:.2f} s")
    return " | ".join(parts)


class RequestLog:
    """ASGI middleware: one INFO line per HTTP request on ``moe_offload.server``."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("path") in QUIET_PATHS:
            await self.app(scope, receive, send)
            return
        t0 = time.perf_counter()
        status = 500     # the app died before it answered: what the client sees

        async def watching_send(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, watching_send)
        finally:
            client = (scope.get("client") or ("", 0))[0]
            record = scope.get("state", {}).get(_STATE_KEY)
            log.info("%s", log_line(scope.get("method", ""), scope.get("path", ""), client,
                                    status, time.perf_counter() - t0, record))


_JSON_TYPES = (b"application/json",)
_TAKEN_AS_JSON = (b"", b"application/x-www-form-urlencoded", b"text/plain")


class JsonBody:
    """ASGI middleware: a request body sent without a Content-Type (or as curl's default form
    type, or text/plain) is read as JSON, as llama-server reads every body. Other types (a
    multipart upload) pass as they are."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope.get("method") in ("POST", "PUT", "PATCH") \
                and scope.get("path") != "/cors-proxy":
            headers = list(scope.get("headers") or [])
            given = next((v for k, v in headers if k == b"content-type"), b"")
            kind = given.split(b";")[0].strip().lower()
            if kind in _TAKEN_AS_JSON:
                headers = [(k, v) for k, v in headers if k != b"content-type"]
                headers.append((b"content-type", _JSON_TYPES[0]))
                scope = dict(scope, headers=headers)
        await self.app(scope, receive, send)
