"""The router's HTTP app: its own routes; every other request goes to its model (dispatch.py).

Own routes (llama-server's router): ``GET /models`` and ``/v1/models`` (every model with its
status), ``POST /models/load`` and ``/models/unload`` (``{"model": NAME}``, answered at once,
the change followed on ``GET /models/sse``), ``GET /props`` without ``?model`` (``role:
"router"``), ``/health``, ``/metrics`` without ``?model`` (the budget pools), the chat page.

Every other request names its model: a POST body's ``"model"``, a GET's ``?model=``. A
missing or unknown name is a 400 in the route's API shape (llama-server's messages); a model
that is not loaded is loaded first (unless ``--no-models-autoload`` or ``?autoload=false``:
a 400), and the request then runs in that model's own app (runtime.server.app, built with
``edge=False``), holding a lease so that nothing unloads the model under it. The seconds it
waited for the load are its ``timings.wake_ms``.
"""
from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import anyio
from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import Response
from sse_starlette.sse import EventSourceResponse

from runtime.errors import UserError
from runtime.server.app import FINGERPRINT, ServerSettings, add_http_edge
from runtime.server.llama_server.cors_proxy import router as cors_proxy_router
from runtime.server.errors import APIError, install_error_handlers
from runtime.server.requests import json_object
from runtime.server.stream_sessions import lookup_answer
from runtime.server.llama_server.unsupported import tools_router
from runtime.server.metrics import CONTENT_TYPE, ServerMetrics
from runtime.server.router.dispatch import Dispatch
from runtime.server.router.models import ModelRouter
from runtime.server.web_ui import PUBLIC_PATHS as UI_PATHS
from runtime.server.web_ui import router as web_ui_router

OWN_PATHS = frozenset({"/health", "/v1/health", "/models", "/v1/models", "/models/load",
                       "/models/unload", "/models/sse", "/cors-proxy", "/v1/streams/lookup",
                       "/tools", *UI_PATHS})
OWN_UNLESS_MODEL = frozenset({"/props", "/metrics"})     # the router's own without ?model=

routes = APIRouter()


def _own(scope) -> bool:
    """A request the router answers itself (else Dispatch forwards it to its model)."""
    path = scope.get("path", "")
    if path in OWN_PATHS or path.startswith("/_app/"):
        return True
    return path in OWN_UNLESS_MODEL and b"model=" not in scope.get("query_string", b"")


def _router(request: Request) -> ModelRouter:
    return request.app.state.router


async def _model_name(request: Request) -> str:
    try:
        body = await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError):
        body = None
    name = body.get("model") if isinstance(body, dict) else None
    if not isinstance(name, str) or not name:
        raise APIError(400, "model: a model name is required", code="invalid_value",
                       param="model")
    return name


@routes.get("/health")
@routes.get("/v1/health")
async def health() -> dict:
    return {"status": "ok"}      # the router answers whatever its models are doing


@routes.get("/models")
@routes.get("/v1/models")
async def list_models(request: Request) -> dict:
    """Every model of the catalogue with its status (llama-server's router listing);
    ``?reload=1`` reads the models directory and the preset again first."""
    router = _router(request)
    if request.query_params.get("reload") and router.read_catalogue is not None:
        try:
            specs = await anyio.to_thread.run_sync(router.read_catalogue)
        except UserError as err:
            raise APIError(400, f"reload: {err}", code="invalid_preset") from None
        await router.reload(specs)
    created = request.app.state.started
    return {"data": [inst.to_json(created, router.pool.held(inst.name))
                     for inst in router.instances.values()], "object": "list"}


async def _named_instance(request: Request, *, unknown: int):
    """The model a ``/models/load|unload`` body names; ``unknown``: the status of a name not
    served (llama-server's: 404 to load, 400 to unload)."""
    name = await _model_name(request)
    inst = _router(request).resolve(name)
    if inst is None:
        raise APIError(unknown, f"model '{name}' is not found", code="model_not_found",
                       error_type="not_found_error" if unknown == 404 else None,
                       param="model")
    return inst


@routes.post("/models/load")
async def load_model(request: Request) -> dict:
    inst = await _named_instance(request, unknown=404)
    if inst.running:
        raise APIError(400, f"model '{inst.name}' is already running",
                       code="model_already_running", param="model")
    _router(request).start_load(inst)
    return {"success": True}


@routes.post("/models/unload")
async def unload_model(request: Request) -> dict:
    inst = await _named_instance(request, unknown=400)
    if not inst.running:
        raise APIError(400, f"model '{inst.name}' is not running", code="model_not_running",
                       param="model")
    _router(request).start_unload(inst)
    return {"success": True}


@routes.get("/models/sse")
async def model_events(request: Request) -> EventSourceResponse:
    """Server-sent events: ``data: {"model", "event", "data"}`` per status change."""
    events = _router(request).events.subscribe()

    async def frames() -> AsyncIterator[dict]:
        async for event in events:
            yield {"data": json.dumps(event)}
    return EventSourceResponse(frames())


@routes.get("/props")
async def router_props(request: Request) -> dict:
    router = _router(request)
    settings = request.app.state.settings
    return {"role": "router", "max_instances": router.models_max,
            "models_autoload": router.autoload, "model_alias": "moe-offload",
            "model_path": "none",
            "default_generation_settings": {"params": {}, "n_ctx": 0},
            "build_info": request.app.state.fingerprint,
            "cors_proxy_enabled": settings.cors_proxy, "is_sleeping": False}


@routes.get("/metrics")
async def router_metrics(request: Request) -> Response:
    """The budget pools and each model's reservation and status (Prometheus text); a model's
    own metrics are ``/metrics?model=NAME``."""
    state = request.app.state
    if not state.settings.metrics_endpoint:
        raise APIError(501, "This server does not support metrics endpoint (start it without "
                            "--no-metrics).", code="not_supported",
                       error_type="not_supported_error")
    router: ModelRouter = state.router
    lines = ["# HELP moe_router_pool_bytes The server's budget pool per device, bytes.",
             "# TYPE moe_router_pool_bytes gauge"]
    pools = router.pool.to_dict()
    lines += [f'moe_router_pool_bytes{{device="{d}"}} {p["pool_bytes"]}'
              for d, p in pools.items()]
    lines += ["# HELP moe_router_reserved_bytes A loaded model's reservation, bytes.",
              "# TYPE moe_router_reserved_bytes gauge"]
    lines += [f'moe_router_reserved_bytes{{device="{d}",model="{m}"}} {n}'
              for d, p in pools.items() for m, n in p["models"].items()]
    lines += ["# HELP moe_router_model_status 1 for the status each model is in.",
              "# TYPE moe_router_model_status gauge"]
    lines += [f'moe_router_model_status{{model="{i.name}",status="{i.status}"}} 1'
              for i in router.instances.values()]
    return Response("\n".join(lines) + "\n" + state.metrics.render(None, True, None),
                    media_type=CONTENT_TYPE)


@routes.post("/v1/streams/lookup")
async def stream_lookup(request: Request) -> list[dict]:
    """Resumable streams (X-Conversation-Id) of every loaded model."""
    router = _router(request)
    return lookup_answer(await json_object(request),
                         [i.app.state.streams for i in router.instances.values() if i.running])


@routes.post("/models")
@routes.delete("/models")
async def not_downloaded() -> None:
    raise APIError(501, "Downloading or deleting models through the router is not supported "
                        "here: put the GGUF file in --models-dir or name it in "
                        "--models-preset.", code="not_supported",
                   error_type="not_supported_error")


def create_router_app(settings: ServerSettings, router: ModelRouter) -> FastAPI:
    """The router's app; ``settings`` are the edge's (key, CORS, limits, chat page)."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await router.start()
        try:
            yield
        finally:
            await router.close()

    app = FastAPI(title="moe-offload", lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None)
    app.state.settings = settings
    app.state.router = router
    app.state.metrics = ServerMetrics()
    app.state.started = int(time.time())
    app.state.fingerprint = FINGERPRINT
    install_error_handlers(app)
    app.include_router(routes)
    app.include_router(cors_proxy_router)
    app.include_router(tools_router)          # built-in tools and MCP off: llama-server's 403
    if settings.web_ui:
        app.include_router(web_ui_router)
    app.add_middleware(Dispatch, router=router,       # inside the key and the limits
                       own=_own)
    add_http_edge(app, settings)
    return app
