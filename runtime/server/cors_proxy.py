"""llama-server's CORS proxy (``--ui-mcp-proxy``; tools/server/server-cors-proxy.h).

A browser page (llama.cpp's web UI, for its MCP servers) cannot call a server that sends no
CORS headers; ``GET|POST /cors-proxy?url=URL`` makes the call from here and answers with the
target's status, content type and body (streamed, so an SSE answer flows as it comes). Only the
headers the page names as ``x-llama-server-proxy-header-NAME: VALUE`` reach the target (as
``NAME: VALUE``): the page's own Authorization, cookies and API key never do. Without the
flag the route is 403, as llama-server answers. It reaches any http(s) URL the server can, so
it is off by default and, as llama-server says, not for untrusted networks (keep --api-key).
"""
from __future__ import annotations

import urllib.error
import urllib.request
from collections.abc import Iterator
from urllib.parse import urlsplit

import anyio
from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse

from runtime.server.errors import APIError

PREFIX = "x-llama-server-proxy-header-"
TIMEOUT_S = 600              # llama-server's read and write timeouts
CHUNK = 64 << 10             # bytes per read of the target's answer

router = APIRouter()


class _KeepErrors(urllib.request.HTTPErrorProcessor):
    """Hand 4xx/5xx answers back as answers (the page sees the target's status)."""

    def http_response(self, request, response):
        return response

    https_response = http_response


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    """A redirect goes back to the page as it came (the page decides where to go)."""

    def redirect_request(self, *args, **kwargs):
        return None


_OPENER = urllib.request.build_opener(_KeepErrors, _NoRedirect)


def _target(url: str) -> str:
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https"):
        raise APIError(400, f"unsupported URL scheme in target URL: {parts.scheme or '(none)'}",
                       param="url", code="invalid_value")
    if not parts.hostname:
        raise APIError(400, "invalid target URL: missing host", param="url",
                       code="invalid_value")
    if parts.password is not None or parts.username is not None:
        raise APIError(400, "authentication in target URL is not supported", param="url",
                       code="invalid_value")
    return url if parts.path else url.replace(parts.netloc, parts.netloc + "/", 1)


def _chunks(response) -> Iterator[bytes]:
    try:
        while chunk := response.read1(CHUNK):
            yield chunk
    finally:
        response.close()


@router.api_route("/cors-proxy", methods=["GET", "POST"])
async def cors_proxy(request: Request) -> StreamingResponse:
    if not request.app.state.settings.cors_proxy:
        raise APIError(403, "The CORS proxy is off: start the server with --ui-mcp-proxy.",
                       code="forbidden")
    url = _target(request.query_params.get("url", ""))
    headers = {k[len(PREFIX):]: v for k, v in request.headers.items()
               if k.startswith(PREFIX) and len(k) > len(PREFIX)}
    body = await request.body() if request.method == "POST" else None
    outgoing = urllib.request.Request(url, data=body, headers=headers, method=request.method)
    try:
        response = await anyio.to_thread.run_sync(
            lambda: _OPENER.open(outgoing, timeout=TIMEOUT_S))
    except (urllib.error.URLError, OSError, ValueError) as exc:
        reason = getattr(exc, "reason", exc)
        raise APIError(502, f"cannot reach {url}: {reason}", code="proxy_error",
                       error_type="server_error") from None
    media_type = response.headers.get("content-type")
    # a sync iterator: Starlette reads it on its thread pool, chunk by chunk
    return StreamingResponse(_chunks(response), status_code=response.status,
                             media_type=media_type)
