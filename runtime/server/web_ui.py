"""The chat page at ``/`` (llama-server serves its web UI there; ``--no-ui`` turns ours off).

A static page (webui/index.html and style.css; app.js streams ``/v1/chat/completions`` and
renders with markdown.js; experts.js polls ``/v1/residency`` for the expert map), nothing
fetched from elsewhere, plus the files a browser asks an installable page for:
``/manifest.webmanifest``, ``/sw.js`` and ``/_app/version.json`` (the path where llama.cpp's
UI reads its build). They are public, as llama-server's static assets are: the page asks for
the API key and sends it with each call.
"""
from __future__ import annotations

from functools import cache
from importlib.resources import files

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

router = APIRouter()

# path -> (file under webui/, media type)
ASSETS = {
    "/": ("index.html", "text/html; charset=utf-8"),
    "/index.html": ("index.html", "text/html; charset=utf-8"),
    "/manifest.webmanifest": ("manifest.webmanifest", "application/manifest+json"),
    "/sw.js": ("sw.js", "text/javascript; charset=utf-8"),
    "/app.js": ("app.js", "text/javascript; charset=utf-8"),
    "/markdown.js": ("markdown.js", "text/javascript; charset=utf-8"),
    "/experts.js": ("experts.js", "text/javascript; charset=utf-8"),
    "/style.css": ("style.css", "text/css; charset=utf-8"),
    # llama-server's UI files are index.html, bundle.js and bundle.css: the same names here
    "/bundle.js": ("bundle.js", "text/javascript; charset=utf-8"),
    "/bundle.css": ("bundle.css", "text/css; charset=utf-8"),
}
PUBLIC_PATHS = frozenset([*ASSETS, "/_app/version.json"])   # no API key needed


@cache
def _read(name: str) -> bytes:
    return files("runtime.server").joinpath("webui", name).read_bytes()


def _asset(path: str):
    name, media_type = ASSETS[path]

    async def serve() -> Response:
        # no-cache: a browser revalidates, so a new build's page is seen at once
        return Response(_read(name), media_type=media_type,
                        headers={"Cache-Control": "no-cache"})
    return serve


for _path in ASSETS:
    router.add_api_route(_path, _asset(_path), methods=["GET"], include_in_schema=False)


@router.get("/_app/version.json", include_in_schema=False)
async def version(request: Request) -> JSONResponse:
    return JSONResponse({"version": request.app.state.fingerprint})
