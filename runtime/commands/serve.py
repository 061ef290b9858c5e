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


def register(subparsers: argparse._SubParsersAction) -> None:
    from runtime.commands.engine_args import HelpFormatter

    parser = subparsers.add_parser(
        "serve", help="serve a model over an OpenAI-compatible HTTP API",
        description="Serve one model over an OpenAI-compatible HTTP API (/v1/chat/completions, "
                    "/v1/completions, /v1/models, with structured output, tools and logprobs) "
                    "and llama-server's own routes (/completion, /tokenize, /detokenize, "
                    "/apply-template, /props, /slots, /infill; /v1/embeddings and /embedding "
                    "with --embedding), resumable streams (X-Conversation-Id, /v1/stream) and a chat "
                    "page at /, plus /v1/residency, /metrics, /health. Without -m, "
                    "--models-dir or --models-preset serve several models (router mode: "
                    "/models, /models/load, /models/unload; a request's \"model\" picks one).",
        formatter_class=HelpFormatter)
    add_serve_args(parser)
    parser.set_defaults(func=run)


def add_serve_args(parser: argparse.ArgumentParser) -> None:
    """Every flag of ``serve`` (also parsed from a router's model presets)."""
    from runtime.commands.engine_args import add_engine_args, add_sampling_args

    add_engine_args(parser)
    add_sampling_args(parser, predict_default=-1)
    parser.set_defaults(temp=0.8)
    for action in parser._actions:  # noqa: SLF001 - say what the sampling flags mean here
        if action.dest in ("predict", "temp", "top_p", "top_k", "min_p", "repeat_penalty",
                           "stop") and action.help:
            action.help += "; the default of requests that do not set it"
    group = parser.add_argument_group("server")
    group.add_argument("--host", default="127.0.0.1",
                       help="address to listen on; a,b listens on several (0.0.0.0 exposes "
                            "the server to the network)")
    group.add_argument("--port", type=int, default=8080, help="TCP port; 0 picks a free one")
    group.add_argument("--api-key", default=None, metavar="KEY",
                       help="require 'Authorization: Bearer KEY' (or 'X-Api-Key: KEY') on every "
                            "route but /health and /models, as llama-server (default: the "
                            "MOE_OFFLOAD_API_KEY environment variable, if set)")
    group.add_argument("-a", "--alias", default=None, metavar="NAME",
                       help="model name shown by /v1/models and in answers; a,b,c gives "
                            "several, the first in sorted order is the id (default: the "
                            "model file's name without .gguf)")
    group.add_argument("--queue-size", type=int, default=16, metavar="N",
                       help="requests that may wait behind the running one; more get 429")
    group.add_argument("-np", "--parallel", type=int, default=1, metavar="N",
                       help="requests generated at once, in one batch per step (continuous "
                            "batching; each gets ctx-size / N tokens, as llama-server)")
    group.add_argument("--embedding", "--embeddings", dest="embedding", action="store_true",
                       help="serve embeddings (/v1/embeddings, /embedding) instead of "
                            "completions")
    group.add_argument("--pooling", default=None, choices=("none", "mean", "cls", "last", "rank"),
                       help="how --embedding pools the tokens' vectors (default: the model's)")
    group.add_argument("--slot-save-path", default=None, metavar="DIR",
                       help="serve POST /slots/ID?action=save|restore|erase (a slot's KV "
                            "cache to a file in DIR and back; DIR is made if missing)")
    group.add_argument("--cache-ram", type=int, default=0, metavar="MiB",
                       help="host memory for llama-server's prompt cache: a slot's KV is "
                            "copied there before a request replaces it, and loaded back when "
                            "its prompt returns; -1: no limit, 0: off (llama-server's default "
                            "is 8192; here host RAM holds the expert tier, so it is opt-in)")
    group.add_argument("--cache-idle-slots", dest="cache_idle_slots", action="store_true",
                       default=True,
                       help="with --cache-ram: copy idle slots to the prompt cache when a "
                            "request starts (with --kv-unified they are emptied too); on by "
                            "default, as llama-server")
    group.add_argument("--no-cache-idle-slots", dest="cache_idle_slots", action="store_false",
                       help="with --cache-ram: leave idle slots alone")
    group.add_argument("--no-context-shift", dest="context_shift", action="store_false",
                       default=False, help="refuse a request whose context fills (the default)")
    group.add_argument("--context-shift", action="store_true",
                       help="when a request's context is full, drop the oldest half after its "
                            "first n_keep tokens and go on generating (llama-server's flag)")
    group.add_argument("-kvu", "--kv-unified", action="store_true",
                       help="with -np N: one KV pool that every request may fill up to -c "
                            "(a request fails with 500 when the pool is full); default: "
                            "ctx-size / N each")
    group.add_argument("--slots", dest="slots", action="store_true", default=True,
                       help="serve GET /slots (llama-server's flag; on by default)")
    group.add_argument("--no-slots", dest="slots", action="store_false",
                       help="answer GET /slots with 501")
    group.add_argument("--cors-origin", "--cors-origins", dest="cors_origin", default="*",
                       metavar="ORIGINS",
                       help="comma-separated browser origins allowed by CORS: a listed "
                            "origin (or 'localhost': any port on localhost, 127.0.0.1, [::1]) "
                            "is echoed with credentials allowed; '*' (the default) answers "
                            "any origin with '*' and no credentials; '' = no CORS headers")
    group.add_argument("--metrics", dest="metrics", action="store_true", default=True,
                       help="serve GET /metrics (on by default here; llama-server's flag)")
    group.add_argument("--no-metrics", dest="metrics", action="store_false",
                       help="answer GET /metrics with 501 (llama-server's default)")
    group.add_argument("-cb", "--cont-batching", action="store_true",
                       help="accepted: -np N batches its requests continuously (llama-server's "
                            "default)")
    group.add_argument("--webui", dest="web_ui", action="store_true", default=True,
                       help="serve the chat page at / (the default)")
    group.add_argument("--no-webui", "--no-ui", dest="web_ui", action="store_false",
                       default=True,
                       help="do not serve the chat page at / (404 there)")
    group.add_argument("--ui-mcp-proxy", "--webui-mcp-proxy", dest="cors_proxy",
                       action="store_true",
                       help="serve GET|POST /cors-proxy?url=URL: the server calls URL for a "
                            "browser page (llama.cpp's web UI uses it for MCP servers); it "
                            "reaches any URL the server can, so keep it off on untrusted "
                            "networks (off: 403); it refuses loopback, private, link-local, "
                            "multicast and metadata addresses unless --ui-mcp-proxy-allow "
                            "names them")
    group.add_argument("--ui-mcp-proxy-allow", default="", metavar="HOSTS",
                       help="comma-separated host names, addresses or networks (CIDR) that "
                            "/cors-proxy may reach although they are internal (e.g. "
                            "127.0.0.1 for an MCP server on this machine)")
    limits = parser.add_argument_group("request limits (a request over one is a 400 naming it)")
    limits.add_argument("--max-body-mib", type=int, default=16, metavar="MiB",
                        help="largest request body (a 400 beyond)")
    limits.add_argument("--max-prompt-tokens", type=int, default=None, metavar="N",
                        help="most prompt tokens per request (default: the context decides)")
    limits.add_argument("--max-grammar-kib", type=int, default=256, metavar="KiB",
                        help="largest grammar or JSON schema")
    limits.add_argument("--max-grammar-repeat", type=int, default=1000, metavar="N",
                        help="largest repetition count in a grammar or schema (minLength, "
                             "maxItems, x{m,n} ...); all of them together: 16x this")
    group.add_argument("--tags", default=None, metavar="A,B",
                       help="the model's tags, listed by /v1/models")
    group.add_argument("--reasoning", default="auto", choices=("on", "off", "auto"),
                       help="thinking in chat templates: off renders them with "
                            "enable_thinking=false (a request's chat_template_kwargs wins)")
    group.add_argument("--reasoning-format", default="auto",
                       choices=("auto", "deepseek", "none"),
                       help="chat answers: the text in <think>...</think> goes to "
                            "reasoning_content (auto, deepseek) or stays in content (none)")
    group.add_argument("--jinja", dest="jinja", action="store_true", default=True,
                       help="accepted: chat templates are always rendered with jinja")
    group.add_argument("--no-jinja", dest="jinja", action="store_false",
                       help="refused: chat templates are always rendered with jinja")
    group.add_argument("--chat-template", default=None, metavar="NAME|JINJA",
                       help="one of llama.cpp's built-in templates by name (chatml, llama3, "
                            "mistral-v7 ...) or a jinja template, instead of the model's")
    group.add_argument("--chat-template-file", default=None, metavar="FILE",
                       help="a jinja chat template to use instead of the model's")
    group.add_argument("--write-profile", default=None, metavar="PROFILE",
                       help="on exit (SIGINT, SIGTERM) write the routing profile of the tokens "
                            "generated while serving (as moe-offload profile), for --profile "
                            "on a later run")
    group.add_argument("--sleep-idle-seconds", type=float, default=-1, metavar="N",
                       help="after N seconds with no request, free the model (its engine and "
                            "the RAM tier's pages) until a request wakes it; /props says "
                            "is_sleeping, answers' timings say wake_ms (-1: never)")
    router = parser.add_argument_group(
        "router mode (several models in one process; give these instead of -m)")
    router.add_argument("--models-dir", default=None, metavar="DIR",
                        help="serve each GGUF file of DIR (named by its file name without "
                             ".gguf) and each subdirectory holding one (named by the "
                             "directory)")
    router.add_argument("--models-preset", default=None, metavar="FILE",
                        help="an INI file, one [NAME] section per model: serve's long flags "
                             "without dashes (model = FILE, ctx-size = 8192, devices.cpu = "
                             "8GiB ...), plus alias, tags, load-on-startup, stop-timeout; "
                             "[*] applies to every model")
    router.add_argument("--models-max", type=int, default=4, metavar="N",
                        help="models loaded at once; loading one more unloads the least "
                             "recently used idle one (0: no limit)")
    router.add_argument("--models-autoload", dest="models_autoload", action="store_true",
                        default=True,
                        help="load a model when a request names it (the default)")
    router.add_argument("--no-models-autoload", dest="models_autoload", action="store_false",
                        help="a request for a model that is not loaded is a 400: load it with "
                             "POST /models/load")


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
        sock.listen(128)
    except OSError as exc:
        sock.close()
        raise UserError(f"{host}:{port}: cannot listen ({exc.strerror})") from None
    sock.set_inheritable(True)
    return sock


def _url(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"http://{f'[{host}]' if ':' in host else host}:{port}"


def _setup_logging(verbose: bool) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("moe-offload: %(message)s"))
    log.addHandler(handler)
    log.setLevel(logging.DEBUG if verbose else logging.INFO)
    log.propagate = False


def run(args: argparse.Namespace) -> int:
    """Serve until interrupted; 0 on a clean stop, a UserError if the model cannot load."""
    from runtime.commands.serve_model import edge_from_args, model_server  # noqa: PLC0415
    from runtime.server.app import create_app  # noqa: PLC0415

    edge = edge_from_args(args)
    if args.models_dir is not None or args.models_preset is not None:
        from runtime.commands.serve_router import router_app  # noqa: PLC0415

        if args.model or args.hf_repo:
            raise UserError("give -m FILE (one model) or --models-dir / --models-preset "
                            "(router mode), not both")
        app = router_app(args, edge)
        _setup_logging(args.verbose)
        models = len(app.state.router.instances)
        loading = sum(i.spec.load_on_startup for i in app.state.router.instances.values())
        return _serve(app, args, edge, what=f"router mode: {models} models, "
                      + (f"loading {loading}" if loading else "each loaded when asked for"))
    server = model_server(args, edge)
    model_path = server.model_path
    model_id = server.settings.model_id
    _setup_logging(args.verbose)
    load_errors: list[str] = []
    t0 = time.perf_counter()
    urls: list[str] = []

    def on_ready() -> None:
        log.info("model %s loaded in %.1f s; serving %s", model_id, time.perf_counter() - t0,
                 ", ".join(f"{u}/v1" for u in urls))

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
    """Listen (every --host, one port), then run uvicorn on ``app`` until interrupted."""
    import uvicorn

    from runtime.server.app import begin_shutdown
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

    class Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame) -> None:   # SIGINT / SIGTERM
            begin_shutdown(app)     # answers in flight end now, not after the drain timeout
            super().handle_exit(sig, frame)

    server = Server(uvicorn.Config(app, log_level="warning", access_log=False,
                                   timeout_graceful_shutdown=3, lifespan="on"))
    app.state.uvicorn = server            # a failed load stops it (single-model mode)
    log.info("listening on %s (%s)", shown, what)
    try:
        server.run(sockets=socks)
    finally:
        for s in socks:
            s.close()
    return 0
