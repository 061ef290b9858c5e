"""``moe-offload serve``: the OpenAI-compatible HTTP server (like llama.cpp's ``llama-server``).

    moe-offload serve -m MODEL [--host 127.0.0.1] [--port 8080] [--api-key KEY] [--alias NAME]
        [--write-profile PROFILE] [--sleep-idle-seconds N]
    moe-offload serve --models-dir DIR | --models-preset FILE [--models-max N]   (router mode)

The port is bound first (so a busy port is a one-line error), then the server answers at once
while the model loads in the background: ``/health`` is 503 until the model is ready. A model
that fails to load stops the server with a one-line error and a non-zero exit. In router mode
(runtime/commands/serve_router.py) no model loads at start: each loads when a request names
it, or with ``POST /models/load``.
"""
from __future__ import annotations

import argparse
import logging
import socket
import sys
import time

from runtime.errors import UserError

log = logging.getLogger("moe_offload.server")
BACKLOG = 128           # connections the event loop accepts at once (descriptors over the cap);
                        # the kernel queues more for it (connection_guard.ACCEPT_QUEUE)


def register(subparsers: argparse._SubParsersAction) -> None:
    from runtime.commands.engine_args import HelpFormatter

    parser = subparsers.add_parser(
        "serve", help="serve a model over an OpenAI-compatible HTTP API",
        description="Serve one model over an OpenAI-compatible HTTP API (/v1/chat/completions, "
                    "/v1/completions, /v1/models, with structured output, tools and logprobs) "
                    "and llama-server's own routes (/completion, /tokenize, /detokenize, "
                    "/apply-template, /props, /slots, /infill, /lora-adapters with --lora; "
                    "/v1/embeddings and /embedding with --embedding; /rerank with "
                    "--reranking), resumable streams (X-Conversation-Id, /v1/stream) and a chat "
                    "page at /, plus /v1/residency, /metrics, /health. Without -m, "
                    "--models-dir or --models-preset serve several models (router mode: "
                    "/models, /models/load, /models/unload; a request's \"model\" picks one).",
        formatter_class=HelpFormatter)
    from runtime.commands.serve_flags import add_serve_args

    add_serve_args(parser)
    parser.set_defaults(func=run)


def _listen(host: str, port: int) -> socket.socket:
    """Bind and listen now, so errors are reported before anything loads."""
    if not 0 <= port <= 65535:
        raise UserError(f"--port: {port} is not a TCP port (0-65535)")
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise UserError(f"--host {host}: cannot resolve ({exc.strerror})") from None
    family, _, _, _, address = infos[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(BACKLOG)
    except OSError as exc:
        sock.close()
        raise UserError(f"{host}:{port}: cannot listen ({exc.strerror})") from None
    sock.set_inheritable(True)
    return sock


def _url(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"http://{f'[{host}]' if ':' in host else host}:{port}"


def _setup_logging(verbose: bool) -> None:
    from runtime.server.request_log import PrintableFormatter

    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(PrintableFormatter("moe-offload: %(message)s"))
    log.addHandler(handler)
    log.setLevel(logging.DEBUG if verbose else logging.INFO)
    log.propagate = False


def run(args: argparse.Namespace) -> int:
    """Serve until interrupted; 0 on a clean stop, a UserError if the model cannot load."""
    from runtime.commands.serve_model import edge_from_args, model_server  # noqa: PLC0415
    from runtime.engine.file_lease import handle_breaks  # noqa: PLC0415
    from runtime.server.app import create_app  # noqa: PLC0415
    from runtime.server.heap import tune_for_serving  # noqa: PLC0415

    tune_for_serving()  # RSS that follows what is held (before the loader and pools start)
    handle_breaks()     # the model file is leased through each batch (engine/model_file.py)
    _setup_logging(args.verbose)         # before the model's checks: they log (debug) too
    edge = edge_from_args(args)
    if args.models_dir is not None or args.models_preset is not None:
        from runtime.commands.serve_router import router_app  # noqa: PLC0415

        if args.model or args.hf_repo:
            raise UserError("give -m FILE (one model) or --models-dir / --models-preset "
                            "(router mode), not both")
        app = router_app(args, edge)
        models = len(app.state.router.instances)
        loading = sum(i.spec.load_on_startup for i in app.state.router.instances.values())
        return _serve(app, args, edge, what=f"router mode: {models} models, "
                      + (f"loading {loading}" if loading else "each loaded when asked for"))
    server = model_server(args, edge)
    model_path = server.model_path
    model_id = server.settings.model_id
    load_errors: list[str] = []
    t0 = time.perf_counter()
    urls: list[str] = []

    def on_ready() -> None:
        page = f"; the chat page: {urls[0]}/" if args.web_ui and urls else ""
        log.info("model %s loaded in %.1f s; serving %s%s", model_id, time.perf_counter() - t0,
                 ", ".join(f"{u}/v1" for u in urls), page)

    def on_failure(message: str) -> None:      # from the loader thread
        load_errors.append(message)
        app.state.uvicorn.should_exit = True

    capture = server.capture

    def on_closed() -> None:             # the engine is closed: its routing is all in
        message = capture.finish()
        if not load_errors:
            log.info("%s", message)

    app = create_app(server.settings, server.load, on_ready=on_ready, on_load_failure=on_failure,
                     on_closed=None if capture is None else on_closed)
    code = _serve(app, args, edge, what=f"loading {model_path.name}", urls=urls)
    if load_errors:
        message = load_errors[0]
        raise UserError(message if message.startswith(str(model_path)) else
                        f"{model_path}: {message}")
    return code


def _serve(app, args: argparse.Namespace, edge, *, what: str,
           urls: list[str] | None = None) -> int:
    """Listen (every --host, one port), then run uvicorn on ``app`` until interrupted, with
    the connection limits (a cap on open connections, a deadline for request heads)."""
    from runtime.server.app import begin_shutdown
    from runtime.server.connection_guard import guarded_server
    from runtime.server.exposure import exposure_warning

    hosts = [h.strip() for h in args.host.split(",") if h.strip()]
    if not hosts:
        raise UserError("--host: no address given")
    socks: list[socket.socket] = []
    try:
        for h in hosts:        # one port for all: the first picks it when --port is 0
            socks.append(_listen(h, socks[0].getsockname()[1] if socks else args.port))
    except UserError:
        for s in socks:
            s.close()
        raise
    if urls is not None:
        urls.extend(_url(s) for s in socks)
    shown = ", ".join(_url(s) for s in socks)
    warning = exposure_warning([s.getsockname()[0] for s in socks], edge.api_key is not None,
                               args.cors_proxy)
    if warning:
        print(warning, file=sys.stderr, flush=True)

    # SIGINT / SIGTERM: answers in flight end now, not after the drain timeout
    server = guarded_server(app, edge.connections, on_exit=lambda: begin_shutdown(app),
                            log_level="warning", access_log=False, timeout_graceful_shutdown=3,
                            lifespan="on", backlog=BACKLOG)
    app.state.uvicorn = server            # a failed load stops it (single-model mode)
    log.info("listening on %s (%s)", shown, what)
    try:
        server.run(sockets=socks)
    finally:
        for s in socks:
            s.close()
    return 0
