"""``moe-offload serve``: the OpenAI-compatible HTTP server (like llama.cpp's ``llama-server``).

    moe-offload serve -m MODEL [--host 127.0.0.1] [--port 8080] [--api-key KEY] [--alias NAME]
        [--write-profile PROFILE]

The port is bound first (so a busy port is a one-line error), then the server answers at once
while the model loads in the background: ``/health`` is 503 until the model is ready. A model
that fails to load stops the server with a one-line error and a non-zero exit.
"""
from __future__ import annotations

import argparse
import logging
import os
import socket
import sys
import time
from pathlib import Path

from runtime.errors import UserError

log = logging.getLogger("moe_offload.server")


def register(subparsers: argparse._SubParsersAction) -> None:
    from runtime.commands.engine_args import HelpFormatter, add_engine_args, add_sampling_args

    parser = subparsers.add_parser(
        "serve", help="serve a model over an OpenAI-compatible HTTP API",
        description="Serve one model over an OpenAI-compatible HTTP API (/v1/chat/completions, "
                    "/v1/completions, /v1/models, with structured output, tools and logprobs) "
                    "and llama-server's own routes (/completion, /tokenize, /detokenize, "
                    "/apply-template, /props, /slots, /infill; /v1/embeddings and /embedding "
                    "with --embedding), resumable streams (X-Conversation-Id, /v1/stream) and a chat "
                    "page at /, plus /v1/residency, /metrics, /health.",
        formatter_class=HelpFormatter)
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
                            "batching; each gets ctx-size / N tokens, as llama-server). Each "
                            "request has its own KV and sampler, but llama.cpp computes a "
                            "shared batch in another order than a lone request, so a greedy "
                            "answer may part from the same request alone where two tokens "
                            "nearly tie (--batch-invariant makes them equal)")
    group.add_argument("--batch-invariant", action="store_true",
                       help="with -np N: decode each request on its own, shaped as when it "
                            "runs alone (its prompt in one piece, then one token per step), "
                            "so every answer equals the same request alone; the requests "
                            "still take turns step by step, without the batching speedup "
                            "(not with --kv-unified, whose shared pool mixes the requests)")
    group.add_argument("--embedding", "--embeddings", dest="embedding", action="store_true",
                       help="serve embeddings (/v1/embeddings, /embedding) instead of "
                            "completions")
    group.add_argument("--pooling", default=None, choices=("none", "mean", "cls", "last", "rank"),
                       help="how --embedding pools the tokens' vectors (default: the model's)")
    group.add_argument("--slot-save-path", default=None, metavar="DIR",
                       help="serve POST /slots/ID?action=save|restore|erase (a slot's KV "
                            "cache to a file in DIR and back, versioned and checksummed, "
                            "checked before a restore; DIR is made if missing)")
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
                            "is echoed with credentials allowed; '*' (the default) lets any "
                            "origin read answers without credentials (a preflight echoes the "
                            "origin with credentials, as llama-server's; the answers carry "
                            "'*'); '' = no CORS headers")
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
                            "on a later run; a failed write (disk full) stops the profile, "
                            "not the server")
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
    import uvicorn

    from gguf_tools.facts import read_model_facts
    from runtime.commands.engine_args import sampling_from_args, settings_from_args
    from runtime.engine.engine import Engine, check_model_path
    from runtime.server.app import ServerSettings, begin_shutdown, create_app
    from runtime.server.cors_proxy import proxy_allow_list
    from runtime.server.exposure import exposure_warning
    from runtime.server.limits import Limits

    from runtime.engine.file_lease import handle_breaks

    handle_breaks()     # the model file is leased through each batch (engine/model_file.py)
    settings = settings_from_args(args)
    model_path = Path(settings.model_path)
    check_model_path(str(model_path))
    read_model_facts(model_path)          # a file that is not a usable GGUF fails here, at once
    if args.cache_ram < -1:
        raise UserError(f"--cache-ram: {args.cache_ram} must be -1 (no limit), 0 (off) or a "
                        "size in MiB")
    if args.queue_size < 0:
        raise UserError(f"--queue-size: {args.queue_size} must be >= 0")
    if not 1 <= args.parallel <= 64:
        raise UserError(f"--parallel: {args.parallel} must be in 1..64")
    if args.batch_invariant and args.kv_unified:
        raise UserError("--batch-invariant needs each request's own KV: not with --kv-unified "
                        "(one shared pool computes a request differently from alone)")
    if not args.jinja:
        raise UserError("--no-jinja: chat templates are always rendered with jinja here")
    template = args.chat_template
    if args.chat_template_file is not None:
        try:
            template = Path(args.chat_template_file).read_text(encoding="utf-8")
        except OSError as exc:
            raise UserError(f"{args.chat_template_file}: cannot read ({exc.strerror})") from None
    defaults = sampling_from_args(args)
    slot_dir = Path(args.slot_save_path) if args.slot_save_path is not None else None
    if slot_dir is not None:               # made when missing, as llama-server does
        try:
            slot_dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise UserError(f"--slot-save-path {slot_dir}: cannot create it "
                            f"({exc.strerror})") from None
    origins = tuple(o.strip() for o in args.cors_origin.split(",") if o.strip())
    try:
        limits = Limits(max_body_bytes=args.max_body_mib << 20,
                        max_prompt_tokens=args.max_prompt_tokens,
                        max_grammar_bytes=args.max_grammar_kib << 10,
                        max_repeat=args.max_grammar_repeat)
        proxy_allow = proxy_allow_list(args.ui_mcp_proxy_allow)
    except ValueError as exc:
        raise UserError(f"serve: {exc}") from None
    api_key = args.api_key if args.api_key is not None else os.environ.get("MOE_OFFLOAD_API_KEY")
    if api_key is not None and not api_key.strip():
        raise UserError("--api-key: must not be empty")
    aliases = tuple(sorted({a.strip() for a in (args.alias or "").split(",") if a.strip()}))
    model_id = aliases[0] if aliases else model_path.name.removesuffix(".gguf")

    _setup_logging(args.verbose)
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
    shown = ", ".join(_url(s) for s in socks)
    warning = exposure_warning([s.getsockname()[0] for s in socks], api_key is not None,
                               args.cors_proxy)
    if warning:
        print(warning, file=sys.stderr, flush=True)
    load_errors: list[str] = []
    t0 = time.perf_counter()

    def on_ready() -> None:
        page = f"; the chat page: {_url(socks[0])}/" if args.web_ui else ""
        log.info("model %s loaded in %.1f s; serving %s%s", model_id, time.perf_counter() - t0,
                 ", ".join(f"{_url(s)}/v1" for s in socks), page)

    def on_failure(message: str) -> None:      # from the loader thread
        load_errors.append(message)
        server.should_exit = True

    settings.n_parallel = args.parallel
    settings.kv_unified = args.kv_unified and args.parallel > 1
    settings.embeddings, settings.pooling = args.embedding, args.pooling
    settings.context_shift = args.context_shift
    prompt_cache = None
    if args.cache_ram != 0 and not args.embedding:
        from runtime.engine.prompt_cache import PromptCache  # noqa: PLC0415

        prompt_cache = PromptCache(max(0, args.cache_ram) << 20)
        log.debug("prompt cache on, limit %s", "none" if args.cache_ram < 0
                  else f"{args.cache_ram} MiB")
        if args.cache_idle_slots:      # llama-server's debug line (its tests read it)
            log.debug("idle slots are saved to the prompt cache when a request starts "
                      "(__TEST_TAG_CACHE_IDLE_SLOTS_ENABLED__)")
    capture = None
    if args.write_profile is not None:
        from runtime.commands.trace_record import ProfileCapture  # noqa: PLC0415

        capture = ProfileCapture(args.write_profile)

    def on_closed() -> None:             # the engine is closed: its routing is all in
        message = capture.finish()
        if not load_errors:
            log.info("%s", message)

    def load() -> Engine:
        engine = Engine(settings, progress=True)
        if capture is not None:
            capture.attach(engine, str(model_path))
        if template is not None:
            engine.use_chat_template(template)
        # embeddings: one input at a time; the prompt cache lives in the slot scheduler
        if (args.parallel > 1 or prompt_cache is not None) and not args.embedding:
            from runtime.engine.batched import BatchScheduler  # noqa: PLC0415

            engine.batcher = BatchScheduler(engine, prompt_cache, args.cache_idle_slots,
                                            batch_invariant=args.batch_invariant)
        return engine

    app = create_app(ServerSettings(model_id=model_id, api_key=api_key,
                                    max_waiting=args.queue_size, slots_endpoint=args.slots,
                                    cors_origins=origins, defaults=defaults,
                                    parallel=args.parallel, aliases=aliases,
                                    verbose=args.verbose, reasoning=args.reasoning,
                                    reasoning_format=args.reasoning_format,
                                    metrics_endpoint=args.metrics, embedding=args.embedding,
                                    slot_save_path=slot_dir, web_ui=args.web_ui,
                                    cors_proxy=args.cors_proxy,
                                    cors_proxy_allow=proxy_allow, limits=limits,
                                    tags=tuple(t.strip() for t in (args.tags or "").split(",")
                                               if t.strip())),
                     load, on_ready=on_ready, on_load_failure=on_failure,
                     on_closed=None if capture is None else on_closed)

    class Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame) -> None:   # SIGINT / SIGTERM
            begin_shutdown(app)     # answers in flight end now, not after the drain timeout
            super().handle_exit(sig, frame)

    server = Server(uvicorn.Config(app, log_level="warning", access_log=False,
                                   timeout_graceful_shutdown=3, lifespan="on"))
    log.info("listening on %s (loading %s)", shown, model_path.name)
    try:
        server.run(sockets=socks)
    finally:
        for s in socks:
            s.close()
    if load_errors:
        message = load_errors[0]
        raise UserError(message if message.startswith(str(model_path)) else
                        f"{model_path}: {message}")
    return 0
