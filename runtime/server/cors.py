"""CORS as llama-server answers it (tools/server/server-http.cpp).

``--cors-origin`` lists the browser origins allowed: ``*`` (the default) reflects any origin,
``localhost`` allows http(s) origins on localhost / 127.0.0.1 / [::1] (any port), and exact
origins allow themselves. An allowed origin is reflected in ``Access-Control-Allow-Origin``
with credentials allowed; a preflight (``OPTIONS``) is answered 200 here, before the API key
is checked, with the methods and headers llama-server allows.
"""
from __future__ import annotations

from urllib.parse import urlsplit

from starlette.datastructures import Headers
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

LOCAL_HOSTS = frozenset({"localhost", "127.0.0.1", "::1"})
ALLOW_METHODS = "GET, POST, DELETE, OPTIONS"


def origin_allowed(origin: str, allowed: tuple[str, ...]) -> bool:
    if "*" in allowed or origin in allowed:
        return True
    if "localhost" in allowed:
        parts = urlsplit(origin)
        return parts.scheme in ("http", "https") and parts.hostname in LOCAL_HOSTS
    return False


class CorsMiddleware:
    def __init__(self, app: ASGIApp, origins: tuple[str, ...]) -> None:
        self.app, self.origins = app, tuple(origins)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        origin = Headers(scope=scope).get("origin")
        allow = origin is not None and origin_allowed(origin, self.origins)
        headers = {"Access-Control-Allow-Origin": origin, "Access-Control-Allow-Credentials":
                   "true", "Access-Control-Allow-Methods": ALLOW_METHODS,
                   "Access-Control-Allow-Headers": "*"} if allow else {}
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
