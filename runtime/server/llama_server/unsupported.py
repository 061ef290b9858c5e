"""llama-server routes this server does not serve: each answers 501 ``not_supported_error``
naming the feature and why, instead of a bare 404 (README, "Not served" says the same).

``/tools`` (llama-server's built-in tools and MCP servers, ``--tools``,
``--mcp-servers-config``) answers exactly as llama-server does when they are off: 403
``{"error": {"message": "this feature is disabled", "type": "feature_disabled"}}``. Running
tools for a client is not served here at all (serve refuses those flags)."""
from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import JSONResponse

from runtime.server.errors import APIError

ROUTER_MODE = ("router mode (several models, loaded on demand) is off: this server serves the "
               "one model given with -m (start serve with --models-dir or --models-preset "
               "instead)")
# (method, path) -> what is not supported
UNSUPPORTED = {
    ("POST", "/models"): ROUTER_MODE,
    ("DELETE", "/models"): ROUTER_MODE,
    ("POST", "/models/load"): ROUTER_MODE,
    ("POST", "/models/unload"): ROUTER_MODE,
    ("GET", "/models/sse"): ROUTER_MODE,
    **{("POST", p): "audio transcription needs a multimodal projector (llama-server's "
                    "--mmproj), which this text-only server does not load"
       for p in ("/v1/audio/transcriptions", "/audio/transcriptions")},
    ("POST", "/props"): "changing the server's properties (llama-server's POST /props) is not "
                        "supported here",
}

router = APIRouter()


def _answer(what: str):
    async def not_supported() -> None:
        raise APIError(501, f"{what}.", code="not_supported", error_type="not_supported_error")
    return not_supported


async def _feature_disabled() -> JSONResponse:
    # llama-server's res_403 (server.cpp): no "code", no "param"
    return JSONResponse({"error": {"message": "this feature is disabled",
                                   "type": "feature_disabled"}}, status_code=403)


for (_method, _path), _what in UNSUPPORTED.items():
    router.add_api_route(_path, _answer(_what), methods=[_method], include_in_schema=False)
tools_router = APIRouter()        # a model's app and the router's (llama-server's top level)
for _method in ("GET", "POST"):
    tools_router.add_api_route("/tools", _feature_disabled, methods=[_method],
                               include_in_schema=False)
