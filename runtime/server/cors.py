"""CORS as llama-server answers it (tools/server/server-http.cpp).

``--cors-origin`` lists the browser origins allowed: exact origins allow themselves and
``localhost`` allows http(s) origins on localhost / 127.0.0.1 / [::1] (any port); a listed
origin is echoed in ``Access-Control-Allow-Origin`` with credentials allowed, on every answer.
``*`` (the default) lets any page read answers: a preflight (``OPTIONS``, answered 200 here
before the API key is checked) echoes the page's ``Origin`` with
``Access-Control-Allow-Credentials: true`` and the methods and headers llama-server allows, as
llama-server's preflight does; the answers themselves carry ``Access-Control-Allow-Origin: *``
and no credentials header (llama-server's carry the origin, also without it). A browser reads
a credentialed answer only when that answer allows credentials, so under ``*`` a page the user
happens to open still cannot read anything with the browser's cookies or HTTP credentials.
"""
from __future__ import annotations

from urllib.parse import urlsplit

from starlette.datastructures import Headers
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

LOCAL_HOSTS = frozenset({"localhost", "127.0.0.1", "::1"})
ALLOW_METHODS = "GET, POST"            # what llama-server's preflight answers


def origin_listed(origin: str, allowed: tuple[str, ...]) -> bool:
    """The origin is named by the list (exactly, or through ``localhost``): credentials ok."""
    if origin in allowed:
        return True
    if "localhost" in allowed:
        try:
            parts = urlsplit(origin)
            return parts.scheme in ("http", "https") and parts.hostname in LOCAL_HOSTS
        except ValueError:         # "http://[x" and the like: not an origin
            return False
    return False


def cors_headers(origin: str | None, allowed: tuple[str, ...],
                 preflight: bool = False) -> dict[str, str]:
    """The CORS headers of an answer to a request from ``origin`` (``preflight``: an
    ``OPTIONS`` request's answer)."""
    if origin is None:
        return {}
    if origin_listed(origin, allowed) or (preflight and "*" in allowed):
        return {"Access-Control-Allow-Origin": origin, "Access-Control-Allow-Credentials":
                "true", "Access-Control-Allow-Methods": ALLOW_METHODS,
                "Access-Control-Allow-Headers": "*", "Vary": "Origin"}
    if "*" in allowed:
        return {"Access-Control-Allow-Origin": "*", "Access-Control-Allow-Methods":
                ALLOW_METHODS, "Access-Control-Allow-Headers": "*"}
    return {}


class CorsMiddleware:
    def __init__(self, app: ASGIApp, origins: tuple[str, ...]) -> None:
        self.app, self.origins = app, tuple(origins)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = cors_headers(Headers(scope=scope).get("origin"), self.origins,
                               preflight=scope["method"] == "OPTIONS")
        # raw, in llama-server's casing: Starlette would lowercase them, and some clients
        # (llama.cpp's own tests among them) read the names case-sensitively
        raw = [(k.encode("latin-1"), v.encode("latin-1")) for k, v in headers.items()]
        if scope["method"] == "OPTIONS":
            response = Response(status_code=200)
            response.raw_headers.extend(raw)
            await response(scope, receive, send)
            return

        async def send_with_cors(message: Message) -> None:
            if message["type"] == "http.response.start" and raw:
                message["headers"] = [*message.get("headers", []), *raw]
            await send(message)

        await self.app(scope, receive, send_with_cors)
