"""Every flag of ``moe-offload serve``: the engine's, sampling, the server's, request limits,
sleep and router mode. The one definition: ``serve`` parses the command line with it, router
mode each model's preset (runtime/commands/serve_router.py)."""
from __future__ import annotations

import argparse


def add_serve_args(parser: argparse.ArgumentParser) -> None:
    """Every flag of ``serve`` (also parsed from a router's model presets)."""
    from runtime.commands.engine_args import add_engine_args, add_sampling_args
    from runtime.server.connection_guard import FD_RESERVE

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
    group.add_argument("--rerank", "--reranking", dest="reranking", action="store_true",
                       help="serve POST /rerank (/reranking, /v1/rerank, /v1/reranking) with a "
                            "reranker model: --embedding --pooling rank, as llama-server")
    adapters = parser.add_argument_group(
        "LoRA adapters (GET|POST /lora-adapters; a request's \"lora\" field)")
    adapters.add_argument("--lora", action="append", default=[], metavar="FNAME",
                          help="a LoRA adapter GGUF at scale 1 (a,b: several; repeatable); ids "
                               "follow the order given (--lora, then --lora-scaled). Adapters "
                               "of attention, shared and output weights only: one of the "
                               "routed experts' is refused. Not with -np > 1 or --cache-ram")
    adapters.add_argument("--lora-scaled", action="append", default=[],
                          metavar="FNAME:SCALE",
                          help="a LoRA adapter at SCALE (a:1,b:0.5: several; repeatable)")
    adapters.add_argument("--lora-init-without-apply", action="store_true",
                          help="load the adapters with scale 0 (set them later with POST "
                               "/lora-adapters or per request)")
    media = parser.add_argument_group(
        "images (image_url parts, Anthropic image blocks, /completion multimodal_data)")
    media.add_argument("-mm", "--mmproj", default=None, metavar="FILE",
                       help="the model's multimodal projector GGUF (its mmproj file): requests "
                            "may carry images (base64 data, inline); without it an image is a "
                            "400 naming this flag. Turns --context-shift off, as llama-server")
    tools = parser.add_argument_group("llama-server's built-in tools and MCP servers")
    for flag, what in (("--tools", "TOOL1,TOOL2"), ("--tools-runtime", "OPTION"),
                       ("--mcp-servers-config", "PATH"), ("--mcp-servers-json", "JSON")):
        tools.add_argument(flag, default=None, metavar=what,
                           help="refused: tools that read, write and run things on this "
                                "machine for a client are not served (/tools answers 403 "
                                "feature_disabled, as llama-server's does without them)")
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
    limits.add_argument("--max-json-depth", type=int, default=128, metavar="N",
                        help="deepest nesting of arrays and objects in a JSON body")
    limits.add_argument("--max-stop-strings", type=int, default=64, metavar="N",
                        help="most stop strings per request")
    limits.add_argument("--max-stop-bytes", type=int, default=4096, metavar="BYTES",
                        help="a request's stop strings together, in UTF-8 bytes")
    limits.add_argument("--max-tokenize-kib", type=int, default=1024, metavar="KiB",
                        help="largest text /tokenize takes")
    limits.add_argument("--max-detokenize-tokens", type=int, default=262144, metavar="N",
                        help="most token ids /detokenize takes")
    conns = parser.add_argument_group("connections and side work (slowloris, floods)")
    conns.add_argument("--max-connections", type=int, default=1024, metavar="N",
                       help="open client connections; a new one past it closes the oldest "
                            "that has sent no request (lowered to the open-file limit less "
                            f"{FD_RESERVE})")
    conns.add_argument("--header-timeout", type=float, default=20.0, metavar="S",
                       help="seconds a connection has to send a whole request head, from "
                            "when it opens or its last answer ends; then it is closed")
    conns.add_argument("--threads-http", type=int, default=2, metavar="N",
                       help="threads for the work beside generation (tokenize, detokenize, "
                            "templates, schema preparation); --queue-size requests may wait "
                            "for one, more get 429")
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
    group.add_argument("--sleep-idle-seconds", type=float, default=-1, metavar="N",
                       help="after N seconds with no request, free the model (its engine and "
                            "the RAM tier's pages) until a request wakes it; /props says "
                            "is_sleeping, answers' timings say wake_ms (default: -1, never)")
    router = parser.add_argument_group(
        "router mode (several models in one process; give these instead of -m)",
        "A request's \"model\" picks the model; each loads when first asked for. The "
        "--devices.X budgets are then the server's, split between the loaded models: each "
        "holds its preset's own devices.X (a size, or N% of the server's) or the budget / "
        "--models-max (docs/serving.md, \"One budget for all the models\").")
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
