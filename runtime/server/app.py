"""The OpenAI-compatible HTTP server: ``create_app`` builds the FastAPI application.

Routes: ``POST /v1/chat/completions``, ``POST /v1/completions`` (openai/completions.py),
``POST /v1/messages`` (anthropic/routes.py), ``POST /v1/responses`` (responses/routes.py),
``GET /v1/models``, ``GET /v1/residency`` (the manager's snapshot as JSON), ``GET /metrics``
(Prometheus text), ``GET /health`` (503 while loading, 200 ``{"status": "ok"}`` when ready),
the chat page at ``/`` (web_ui.py). With an API key set, every route but ``/health``,
``/models`` and the page's static files wants ``Authorization: Bearer KEY``.

The engine is loaded on a background thread once the server runs (see model_host.py); requests
are served in order by the bounded queue (queue.py), and the work beside generation
(tokenizing, templates, schema preparation) by a small bounded pool (side_work.py). With
``sleep_idle_seconds`` the model falls asleep when idle and the next request wakes it
(lifecycle.py). In router mode (router/) one such app runs per loaded model, built with
``edge=False``: the router's own app does the logging, CORS and the API key.
"""
from __future__ import annotations

import hmac
import json
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.datastructures import Headers
from starlette.types import ASGIApp, Receive, Scope, Send

from runtime.engine.sampling import SamplingParams
from runtime.server.llama_server import gcp_predict
from runtime.server.anthropic.routes import router as anthropic_router
from runtime.server.body_guard import BodyGuard
from runtime.server.openai.completions import router as completions_router
from runtime.server.cors import CorsMiddleware
from runtime.server.llama_server.cors_proxy import router as cors_proxy_router
from runtime.server.embeddings import router as embeddings_router
from runtime.server.llama_server.routes import router as llama_router
from runtime.server.responses.routes import router as responses_router
from runtime.server.llama_server.slots import router as slot_router
from runtime.server.stream_sessions import StreamSessions
from runtime.server.stream_sessions import router as stream_router
from runtime.server.llama_server.unsupported import router as unsupported_router
from runtime.server.llama_server.unsupported import tools_router
from runtime.server.llama_server.rerank import router as rerank_router
from runtime.server.llama_server.lora import router as lora_router
from runtime.server.web_ui import PUBLIC_PATHS as UI_PATHS
from runtime.server.web_ui import router as web_ui_router
from runtime.server.errors import (APIError, error_body, route_response,
                                   install_error_handlers)
from runtime.server.llama_server.metrics import LlamaCppCounters, window_spent
from runtime.server.metrics import CONTENT_TYPE, RequestCounter, ServerMetrics
from runtime.server.request_log import JsonBody, RequestLog
from runtime.server.lifecycle import Lifecycle, LifecycleGate, Snapshot
from runtime.server.model_host import LoadState, ModelHost
from runtime.server.limits import Limits
from runtime.server.queue import RequestQueue
from runtime.server.side_work import SideWork
from runtime.server.reasoning import FORMATS
from runtime.version import package_version


def _fingerprint() -> str:
    # llama-server's form is "b<build>-<commit>": clients test the leading "b"
    return f"b{package_version('moe-offload') or 0}-moe-offload"


FINGERPRINT = _fingerprint()   # system_fingerprint: this server's build


@dataclass(frozen=True)
class ServerSettings:
    """What the server needs beyond the engine."""

    model_id: str                      # the name /v1/models lists and answers carry
    api_key: str | None = None         # None: no authentication
    max_waiting: int = 16              # requests that may wait behind the running one (429 beyond)
    slots_endpoint: bool = True        # GET /slots (llama-server's --slots / --no-slots)
    cors_origins: tuple[str, ...] = ("*",)   # browsers' origins allowed (CORS)
    defaults: Any = None               # SamplingParams: the server's own -n/--temp/... defaults
    parallel: int = 1                  # requests generated at once (-np; continuous batching)
    aliases: tuple[str, ...] = ()      # every name of the model (--alias a,b,c); model_id first
    verbose: bool = False              # answers carry "__verbose" (the prompt), as llama-server -v
    reasoning: str = "auto"            # --reasoning on|off|auto: off renders enable_thinking=false
    reasoning_format: str = "auto"     # --reasoning-format: auto/deepseek split <think>; none
    metrics_endpoint: bool = True      # GET /metrics (501 with --no-metrics, as llama-server)
    tags: tuple[str, ...] = ()         # --tags: the model's tags in /v1/models
    embedding: bool = False            # --embedding: embeddings routes on, generation off
    slot_save_path: Any = None         # Path: where /slots/{id}?action=save|restore files go
    web_ui: bool = True                # the chat page at / (llama-server's --no-ui: 404)
    cors_proxy: bool = False           # GET|POST /cors-proxy?url= (--ui-mcp-proxy); else 403
    # hosts / addresses / networks /cors-proxy may reach although internal (--ui-mcp-proxy-allow)
    cors_proxy_allow: tuple[str, ...] = ()
    limits: Limits = field(default_factory=Limits)   # what one request may ask (limits.py)
    # threads for tokenizing, templates and schema preparation (--threads-http; side_work.py)
    threads_http: int = 2
    sleep_idle_seconds: float | None = None   # --sleep-idle-seconds: None = never sleeps
    mmproj: str | None = None          # --mmproj: images in requests ("multimodal")

    def __post_init__(self) -> None:
        if self.max_waiting < 0:
            raise ValueError("max_waiting must be >= 0")
        if self.threads_http < 1:
            raise ValueError("threads_http must be >= 1")
        if self.api_key is not None and not self.api_key:
            raise ValueError("api_key must not be empty")
        if self.reasoning not in ("on", "off", "auto"):
            raise ValueError(f"reasoning must be on, off or auto, not {self.reasoning!r}")
        if self.sleep_idle_seconds is not None and self.sleep_idle_seconds < 0:
            raise ValueError("sleep_idle_seconds must be >= 0 (None: never sleep)")
        if self.reasoning_format not in FORMATS:
            raise ValueError(f"reasoning_format must be auto, deepseek or none, not "
                             f"{self.reasoning_format!r}")


class ApiKeyGuard:
    """ASGI middleware: 401 unless the request carries ``Authorization: Bearer KEY``.

    Runs before routing and body parsing, so a request without the key learns nothing else
    (not even whether its JSON was valid). ``/health`` stays open for load balancers.
    """

    # as llama-server: health, the model list and the web UI's static files
    OPEN_PATHS = frozenset({"/health", "/v1/health", "/models", "/v1/models", *UI_PATHS})

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self._key = api_key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("path") in self.OPEN_PATHS \
                or scope.get("method") == "OPTIONS":        # CORS preflights carry no key
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        error = self._check(headers.get("authorization", ""), headers.get("x-api-key"))
        if error is None:
            await self.app(scope, receive, send)
        else:                                   # in the shape of the route's API
            await route_response(scope.get("path", ""), error)(scope, receive, send)

    def _check(self, header: str, x_api_key: str | None) -> APIError | None:
        scheme, _, token = header.partition(" ")
        if x_api_key and not (scheme.lower() == "bearer" and token.strip()):
            scheme, token = "bearer", x_api_key          # Anthropic-style clients' header
        if scheme.lower() != "bearer" or not token.strip():
            return APIError(401, "Missing API key: send it as 'Authorization: Bearer KEY' "
                                 "(or 'X-Api-Key: KEY').",
                            code="missing_api_key", headers={"WWW-Authenticate": "Bearer"})
        if not hmac.compare_digest(token.strip().encode(), self._key):
            return APIError(401, "Incorrect API key provided.", code="invalid_api_key",
                            headers={"WWW-Authenticate": "Bearer"})
        return None


info_router = APIRouter()


@info_router.get("/v1/models")
@info_router.get("/models")
async def list_models(request: Request) -> dict:
    """The one model this process serves, in OpenAI's list (``data``) and in llama-server's
    ``models`` list with its capabilities (``completion``, or ``embedding`` with --embedding;
    ``multimodal`` too with --mmproj, as llama-server)."""
    host: ModelHost = request.app.state.host
    settings = request.app.state.settings
    aliases = settings.aliases or (host.model_id,)
    # llama-server's capabilities: what the model answers here
    capabilities = ["embedding"] if settings.embedding else \
        ["completion", "multimodal"] if settings.mmproj else ["completion"]
    return {"models": [{
                "name": host.model_id, "model": host.model_id, "modified_at": "", "size": "",
                "digest": "", "type": "model", "description": "", "tags": list(settings.tags),
                "capabilities": capabilities, "parameters": "",
                "details": {"parent_model": "", "format": "gguf", "family": "", "families": [],
                            "parameter_size": "", "quantization_level": ""}}],
            "object": "list", "data": [{
                "id": host.model_id, "object": "model", "created": request.app.state.started,
                "owned_by": "moe-offload", "aliases": list(aliases),
                "tags": list(settings.tags), "capabilities": capabilities}]}


@info_router.get("/v1/residency")
async def residency(request: Request) -> Response:
    """The residency manager's snapshot as JSON, with every device's expert map."""
    engine = request.app.state.host.engine()
    manager = getattr(engine, "manager", None)
    remote = getattr(engine, "remote", None)
    if manager is None and remote is None:
        raise APIError(404, "Residency management is off for this model, so there is no "
                            "snapshot.", code="residency_disabled")
    # experts: each expert's state and access count (the chat page's heat map)
    payload = manager.snapshot(experts=True).to_json() if manager is not None else {}
    if remote is not None:              # the remote plan and each remote's link state
        if isinstance(payload, str):
            payload = json.loads(payload)
        payload["remote"] = remote.to_dict()
    if not isinstance(payload, str):
        payload = json.dumps(payload)
    return Response(payload, media_type="application/json")


@info_router.get("/metrics")
async def metrics(request: Request) -> Response:
    """Prometheus text: request and token counters, then the manager's moe_expert_* series.
    While the model sleeps: the text it had as it fell asleep (llama-server's snapshot), whose
    rates read 0 after its first scrape (a window with nothing run)."""
    state = request.app.state
    if not state.settings.metrics_endpoint:
        raise APIError(501, "This server does not support metrics endpoint (start it without "
                            "--no-metrics).", code="not_supported",
                       error_type="not_supported_error")
    snapshot = state.lifecycle.snapshot
    if snapshot is not None and snapshot.metrics is not None and state.lifecycle.sleeping:
        text = snapshot.metrics
        state.lifecycle.snapshot = Snapshot(snapshot.props, window_spent(text))
    else:
        text = metrics_text(state)
        state.lifecycle.served_metrics(text)
    response = Response(text, media_type=CONTENT_TYPE)
    # raw, in llama-server's casing (Starlette lowercases header names it is given)
    response.raw_headers.append((b"Process-Start-Time-Unix", str(state.started).encode()))
    return response


def metrics_text(state: Any) -> str:
    """``GET /metrics``'s text for an app's ``state``."""
    engine = state.host.engine_if_ready()
    manager = getattr(engine, "manager", None) if engine is not None else None
    residency_text = manager.snapshot().to_prometheus() if manager is not None else None
    if residency_text is not None:      # the tiers' own truth (e.g. mincore) next to the manager's
        residency_text += "".join(tier.to_prometheus() for tier in engine.tiers
                                  if hasattr(tier, "to_prometheus"))
    queue = state.queue.stats() if state.queue is not None else None
    text = state.metrics.render(queue, engine is not None, residency_text)
    batcher = getattr(engine, "batcher", None)
    decodes = batcher.steps if batcher is not None else getattr(engine, "decode_calls", 0)
    busy = batcher.busy_per_step() if batcher is not None else float(bool(decodes))
    text += state.llamacpp.render(queue, decodes, busy)
    if getattr(state, "side_work", None) is not None:
        text += state.side_work.to_prometheus()
    remote = getattr(engine, "remote", None) if engine is not None else None
    if remote is not None:
        text += remote.to_prometheus()
    return text


def degraded(engine: Any) -> JSONResponse | None:
    """/health's answer while a part of ``engine`` is broken (``Engine.faults()``: the model
    file changed, a writer stopped), else None."""
    faults = engine.faults() if engine is not None and hasattr(engine, "faults") else []
    if not faults:
        return None
    parts = {f.component: f.message for f in faults}
    fatal = [f for f in faults if not f.serving]
    if not fatal:                              # serving still: no balancer should drop it
        return JSONResponse({"status": "degraded", "degraded": parts})
    body = error_body(fatal[0].message, "unavailable_error", f"{fatal[0].component}_broken")
    return JSONResponse(body | {"status": "degraded", "degraded": parts}, status_code=503)


def begin_shutdown(app: FastAPI) -> None:
    """Cancel every queued and running generation now, so that answers in flight end (with
    a ``server_shutdown`` error) while the server still drains its connections."""
    queue = getattr(app.state, "queue", None)
    if queue is not None:
        queue.cancel_all()
    router = getattr(app.state, "router", None)       # router mode: every loaded model's
    for inst in (router.instances.values() if router is not None else ()):
        if inst.app is not None:
            begin_shutdown(inst.app)


def start_serving(app: FastAPI) -> None:
    """Start the app's queue, its model's load and (with sleep) its idle watcher; on the
    event loop (uvicorn's lifespan, or a router loading the model)."""
    state = app.state
    state.queue = RequestQueue(state.settings.max_waiting, workers=state.settings.parallel)
    state.side_work = SideWork(state.settings.threads_http, state.settings.max_waiting)
    state.host.start(on_ready=state.hooks["on_ready"], on_failure=state.hooks["on_failure"])
    state.lifecycle.start()


def stop_serving(app: FastAPI) -> None:
    """Stop what ``start_serving`` started and close the engine (blocking while a load or a
    generation ends: a router runs it off the event loop)."""
    state = app.state
    state.lifecycle.stop()
    state.streams.stop_all()
    if state.queue is not None:
        state.queue.close()
    state.host.close()
    if state.hooks["on_closed"] is not None:
        state.hooks["on_closed"]()


def create_app(settings: ServerSettings, load_engine: Callable[[], Any], *,
               on_load_failure: Callable[[str], None] | None = None,
               on_ready: Callable[[], None] | None = None,
               on_closed: Callable[[], None] | None = None,
               edge: bool = True) -> FastAPI:
    """Build the app. ``load_engine()`` runs on a background thread once the server starts;
    ``on_load_failure(message)`` / ``on_ready()`` are called from that thread afterwards;
    ``on_closed()`` at shutdown, once the engine is closed (uvicorn re-raises SIGINT / SIGTERM
    after the shutdown, so nothing after ``server.run`` is sure to run). ``edge=False``: a
    model app behind a router, which logs requests, checks the key, answers CORS and serves
    the chat page itself."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        start_serving(app)
        try:
            yield
        finally:
            stop_serving(app)

    app = FastAPI(title="moe-offload", lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None)
    app.state.settings = settings
    app.state.host = ModelHost(load_engine, settings.model_id)
    app.state.hooks = {"on_ready": on_ready, "on_failure": on_load_failure,
                       "on_closed": on_closed}

    def queue_busy() -> bool:
        stats = app.state.queue.stats() if app.state.queue is not None else None
        return stats is not None and (stats.running > 0 or stats.waiting > 0)

    def take_snapshot() -> Snapshot:
        from runtime.server.llama_server.routes import props_payload  # noqa: PLC0415

        request = Request({"type": "http", "app": app, "headers": [], "query_string": b""})
        return Snapshot(props_payload(request), metrics_text(app.state)
                        if settings.metrics_endpoint else None)

    app.state.lifecycle = Lifecycle(app.state.host, idle_seconds=settings.sleep_idle_seconds,
                                    queue_busy=queue_busy, take_snapshot=take_snapshot)
    app.state.metrics = ServerMetrics()
    app.state.llamacpp = LlamaCppCounters()
    app.state.queue = None
    app.state.streams = StreamSessions()    # resumable streams (X-Conversation-Id)
    app.state.started = int(time.time())
    app.state.defaults = settings.defaults if settings.defaults is not None else \
        SamplingParams()
    app.state.fingerprint = FINGERPRINT
    install_error_handlers(app)

    @app.get("/health")
    @app.get("/v1/health")
    async def health(request: Request) -> JSONResponse:
        """200 ``{"status": "ok"}`` when the model is loaded, 503 with an error body before;
        ``"status": "degraded"`` with ``degraded: {component: message}`` while a part is
        broken: 200 when generations go on without it, else 503."""
        host: ModelHost = request.app.state.host
        if host.state is LoadState.SLEEPING:      # llama-server: 200 while asleep
            return JSONResponse({"status": "ok"})
        if host.state is LoadState.READY:
            faults = degraded(host.engine_if_ready())
            if faults is not None:
                return faults
            remote = getattr(host.engine_if_ready(), "remote", None)
            status = remote.status() if remote is not None else {}
            down = [d for d, state in status.items() if state == "down"]
            if down:                    # up, but cannot generate until reloaded
                body = error_body(f"{', '.join(down)}: remote device down; restart the server "
                                  "once it is back", "unavailable_error", "remote_device_down")
                body["devices"] = status
                return JSONResponse(body, status_code=503)
            return JSONResponse({"status": "ok", "devices": status} if status else
                                {"status": "ok"})
        if host.state is LoadState.LOADING:
            return JSONResponse(error_body("Loading model", "unavailable_error",
                                           "model_loading"), status_code=503)
        return JSONResponse(error_body(f"The model failed to load: {host.error}",
                                       "unavailable_error", "model_load_failed"),
                            status_code=503)

    app.include_router(info_router)
    app.include_router(completions_router)
    app.include_router(anthropic_router)       # /v1/messages: translated to chat completions
    app.include_router(responses_router)       # /v1/responses: likewise
    app.include_router(llama_router)
    app.include_router(embeddings_router)
    app.include_router(rerank_router)          # /rerank with --reranking
    app.include_router(lora_router)            # /lora-adapters
    app.include_router(slot_router)
    app.include_router(stream_router)
    app.include_router(cors_proxy_router)
    app.include_router(unsupported_router)     # 501s naming what is not served
    app.include_router(tools_router)           # llama-server's 403 with tools off
    if settings.web_ui and edge:
        app.include_router(web_ui_router)
    gcp_predict.install(app)             # Vertex AI's /predict, with AIP_MODE=PREDICTION
    # innermost: only a request past the key and the limits may wake the model
    app.add_middleware(LifecycleGate, lifecycle=app.state.lifecycle)
    add_http_edge(app, settings, edge=edge)
    return app


def add_http_edge(app: FastAPI, settings: ServerSettings, *, edge: bool = True) -> None:
    """The middleware around an app's routes (added after its own inner ones), inside out:
    body limits, the API key, CORS, JSON bodies, request counts, the request log. Without
    ``edge`` (a model app behind a router) the key, CORS and the log are the router's."""
    app.add_middleware(BodyGuard, limits=settings.limits)     # inside the key guard
    if settings.api_key is not None and edge:
        app.add_middleware(ApiKeyGuard, api_key=settings.api_key)
    if settings.cors_origins and edge:   # outside the key guard: preflights need no key
        app.add_middleware(CorsMiddleware, origins=settings.cors_origins)
    app.add_middleware(JsonBody)         # a body without a Content-Type is JSON (llama-server)
    app.add_middleware(RequestCounter, metrics=app.state.metrics)   # counts 401s too
    if edge:
        app.add_middleware(RequestLog)   # outermost: one line per request, 401s included
