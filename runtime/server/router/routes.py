"""The router's HTTP app: its own routes, and every other request forwarded to its model.

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

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import Response
from sse_starlette.sse import EventSourceResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from runtime.server.app import FINGERPRINT, ServerSettings, add_http_edge
from runtime.server.cors_proxy import router as cors_proxy_router
from runtime.server.errors import APIError, install_error_handlers, route_response
from runtime.server.lifecycle import WAKE_SECONDS, wakes_model
from runtime.server.metrics import CONTENT_TYPE, ServerMetrics
from runtime.server.router.models import ModelRouter
from runtime.server.web_ui import PUBLIC_PATHS as UI_PATHS
from runtime.server.web_ui import router as web_ui_router

OWN_PATHS = frozenset({"/health", "/v1/health", "/models", "/v1/models", "/models/load",
                       "/models/unload", "/models/sse", "/cors-proxy", *UI_PATHS})
OWN_UNLESS_MODEL = frozenset({"/props", "/metrics"})     # the router's own without ?model=
BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})

routes = APIRouter()


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
    """Every model of the catalogue with its status (llama-server's router listing)."""
    router = _router(request)
    created = request.app.state.started
    return {"data": [inst.to_json(created, router.pool.held(inst.name))
                     for inst in router.instances.values()], "object": "list"}


@routes.post("/models/load")
async def load_model(request: Request) -> dict:
    router = _router(request)
    name = await _model_name(request)
    inst = router.resolve(name)
    if inst is None:
        raise APIError(404, f"model '{name}' is not found", code="model_not_found",
                       error_type="not_found_error", param="model")
    if inst.running:
        raise APIError(400, f"model '{inst.name}' is already running",
                       code="model_already_running", param="model")
    router.start_load(inst)
    return {"success": True}


@routes.post("/models/unload")
async def unload_model(request: Request) -> dict:
    router = _router(request)
    name = await _model_name(request)
    inst = router.resolve(name)
    if inst is None:
        raise APIError(400, f"model '{name}' is not found", code="model_not_found",
                       param="model")
    if not inst.running:
        raise APIError(400, f"model '{inst.name}' is not running", code="model_not_running",
                       param="model")
    router.start_unload(inst)
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


@routes.post("/models")
@routes.delete("/models")
async def not_downloaded() -> None:
    raise APIError(501, "Downloading or deleting models through the router is not supported "
                        "here: put the GGUF file in --models-dir or name it in "
                        "--models-preset.", code="not_supported",
                   error_type="not_supported_error")


class Dispatch:
    """ASGI middleware (innermost): a request for a model goes to that model's app."""

    def __init__(self, app: ASGIApp, router: ModelRouter) -> None:
        self.app = app
        self.router = router

    def _own(self, scope: Scope) -> bool:
        path = scope.get("path", "")
        if path in OWN_PATHS or path.startswith("/_app/"):
            return True
        return path in OWN_UNLESS_MODEL and b"model=" not in scope.get("query_string", b"")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or self._own(scope):
            await self.app(scope, receive, send)
            return
        body: bytes | None = None
        try:
            if scope.get("method") in BODY_METHODS:
                body = await _read_body(receive)
                if body is None:          # the client left while sending
                    return
            inst, autoload = self._choose(scope, body)
            waited = await self.router.acquire(inst, autoload=autoload)
        except APIError as err:
            await route_response(scope.get("path", ""), err)(scope, receive, send)
            return
        try:
            if waited is not None:
                WAKE_SECONDS.set(waited)
            child = dict(scope)           # the same "state": the request log reads it
            await inst.app(child, receive if body is None else _replay(body, receive), send)
        finally:
            self.router.release(inst, used=wakes_model(scope))

    def _choose(self, scope: Scope, body: bytes | None):
        """(the model instance, autoload) for this request; APIError 400 naming why not."""
        query = Request(scope).query_params
        if body is None:
            name = query.get("model")
        else:
            try:
                parsed = json.loads(body) if body else None
            except (json.JSONDecodeError, UnicodeDecodeError):
                parsed = None
            name = parsed.get("model") if isinstance(parsed, dict) else None
        if not isinstance(name, str) or not name:
            where = "?model=NAME" if body is None else '"model" in the body'
            raise APIError(400, f"model name is missing from the request ({where}: this "
                                f"server serves several models, see GET /models)",
                           code="model_missing", param="model")
        inst = self.router.resolve(name)
        if inst is None:
            served = ", ".join(sorted(self.router.instances))
            raise APIError(400, f"model '{name}' not found (served here: {served})",
                           code="model_not_found", param="model")
        autoload = query.get("autoload")
        return inst, self.router.autoload if autoload is None else autoload in ("true", "1")


async def _read_body(receive: Receive) -> bytes | None:
    chunks = []
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            return b"".join(chunks)


def _replay(body: bytes, receive: Receive) -> Receive:
    """``receive`` that gives ``body`` once, then the client's later messages (a
    disconnect: what stops a stream)."""
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()
    return replay


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
    if settings.web_ui:
        app.include_router(web_ui_router)
    app.add_middleware(Dispatch, router=router)       # inside the key and the limits
    add_http_edge(app, settings)
    return app
