"""One model's server app from ``serve``'s flags: the checks, the engine's settings, the load.

``serve -m MODEL`` builds one (runtime/commands/serve.py); router mode builds one per loaded
model from its preset's flags (runtime/commands/serve_router.py), behind the router's edge.
Every bad value is a one-line UserError before anything loads.
"""
from __future__ import annotations

import argparse
import logging
import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from runtime.errors import UserError

log = logging.getLogger("moe_offload.server")


@dataclass(frozen=True)
class Edge:
    """What the server's HTTP edge takes from the flags (one per process, router or not)."""

    api_key: str | None
    origins: tuple[str, ...]
    limits: Any                    # runtime.server.limits.Limits
    proxy_allow: tuple[str, ...]
    connections: Any = None        # runtime.server.connection_guard.ConnectionLimits


def edge_from_args(args: argparse.Namespace) -> Edge:
    """The key, CORS origins, request and connection limits and proxy allow-list; UserError
    on bad ones."""
    from runtime.server.connection_guard import ConnectionLimits  # noqa: PLC0415
    from runtime.server.llama_server.cors_proxy import proxy_allow_list  # noqa: PLC0415
    from runtime.server.limits import Limits  # noqa: PLC0415

    origins = tuple(o.strip() for o in args.cors_origin.split(",") if o.strip())
    try:
        limits = Limits(max_body_bytes=args.max_body_mib << 20,
                        max_prompt_tokens=args.max_prompt_tokens,
                        max_grammar_bytes=args.max_grammar_kib << 10,
                        max_repeat=args.max_grammar_repeat, max_json_depth=args.max_json_depth,
                        max_stop_strings=args.max_stop_strings,
                        max_stop_bytes=args.max_stop_bytes,
                        max_tokenize_bytes=args.max_tokenize_kib << 10,
                        max_detokenize_tokens=args.max_detokenize_tokens)
        connections = ConnectionLimits(args.max_connections, args.header_timeout)
        if args.threads_http < 1:
            raise ValueError("--threads-http must be >= 1")
        proxy_allow = proxy_allow_list(args.ui_mcp_proxy_allow)
    except ValueError as exc:
        raise UserError(f"serve: {exc}") from None
    api_key = args.api_key if args.api_key is not None else os.environ.get("MOE_OFFLOAD_API_KEY")
    if api_key is not None and not api_key.strip():
        raise UserError("--api-key: must not be empty")
    return Edge(api_key, origins, limits, tuple(proxy_allow), connections)


@dataclass
class ModelServer:
    """A model's server settings and the blocking factory of its engine."""

    settings: Any                  # runtime.server.app.ServerSettings
    engine_settings: Any           # runtime.engine.types.EngineSettings
    load: Callable[[], Any]        # -> Engine (on the loader thread)
    capture: Any = None            # ProfileCapture with --write-profile

    @property
    def model_path(self) -> Path:
        return Path(self.engine_settings.model_path)


def check_server_args(args: argparse.Namespace) -> None:
    """The server flags' own checks (no file is read)."""
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
    if args.sleep_idle_seconds is not None and args.sleep_idle_seconds < -1:
        raise UserError(f"--sleep-idle-seconds: {args.sleep_idle_seconds:g} must be -1 (never) "
                        "or a number of seconds >= 0")
    for flag in ("tools", "tools_runtime", "mcp_servers_config", "mcp_servers_json"):
        if getattr(args, flag, None) is not None:
            raise UserError(f"--{flag.replace('_', '-')}: llama-server's built-in tools and MCP "
                            "servers (programs the server runs for a client) are not served "
                            "here; /tools answers 403 feature_disabled, as llama-server's does "
                            "without them")
    if lora_specs(args) and (args.parallel > 1 or args.cache_ram != 0):
        raise UserError("--lora: not with -np > 1 or --cache-ram (the slots decode in one "
                        "batch and cached prompts keep their KV, while LoRA scales are the "
                        "context's: one request's scales would change the others')")
    if args.write_profile is not None and sleeps(args):
        raise UserError("--write-profile records one engine's routing; with "
                        "--sleep-idle-seconds the engine is loaded again at each wake: give "
                        "one or the other")


def lora_specs(args: argparse.Namespace) -> tuple[tuple[str, float], ...]:
    """``(path, scale)`` of each adapter, in id order: --lora's (scale 1), then
    --lora-scaled's (FNAME:SCALE); comma-separated lists as llama-server's."""
    specs = [(p.strip(), 1.0) for value in getattr(args, "lora", None) or ()
             for p in value.split(",") if p.strip()]
    for value in getattr(args, "lora_scaled", None) or ():
        for item in (i.strip() for i in value.split(",") if i.strip()):
            path, sep, scale = item.rpartition(":")
            try:
                if not sep or not path or not math.isfinite(float(scale)):
                    raise ValueError
                specs.append((path, float(scale)))
            except ValueError:
                raise UserError(f"--lora-scaled {item}: want FNAME:SCALE (e.g. "
                                "adapter.gguf:0.5)") from None
    return tuple(specs)


def sleeps(args: argparse.Namespace) -> bool:
    return args.sleep_idle_seconds is not None and args.sleep_idle_seconds >= 0


def model_server(args: argparse.Namespace, edge: Edge, *, model_id: str | None = None,
                 aliases: tuple[str, ...] | None = None) -> ModelServer:
    """The model's ServerSettings and engine factory from ``serve``'s flags. ``model_id`` /
    ``aliases``: a router's name for it (default: ``--alias``, else the file's name)."""
    from gguf_tools.facts import read_model_facts  # noqa: PLC0415
    from runtime.commands.engine_args import (sampling_from_args,  # noqa: PLC0415
                                              settings_from_args)
    from runtime.engine.engine import Engine, check_model_path  # noqa: PLC0415
    from runtime.server.app import ServerSettings  # noqa: PLC0415

    check_server_args(args)
    settings = settings_from_args(args)
    model_path = Path(settings.model_path)
    check_model_path(str(model_path))
    read_model_facts(model_path)          # a file that is not a usable GGUF fails here, at once
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
    if aliases is None:
        aliases = tuple(sorted({a.strip() for a in (args.alias or "").split(",") if a.strip()}))
    if model_id is None:
        model_id = aliases[0] if aliases else model_path.name.removesuffix(".gguf")
    settings.n_parallel = args.parallel
    settings.kv_unified = args.kv_unified and args.parallel > 1
    if args.reranking:                 # llama-server's --reranking
        if args.pooling not in (None, "rank"):
            raise UserError(f"--reranking ranks with pooling rank, not --pooling {args.pooling}")
        args.embedding, args.pooling = True, "rank"
    settings.embeddings, settings.pooling = args.embedding, args.pooling
    settings.lora = lora_specs(args)
    if settings.lora:
        from runtime.engine.lora import check_adapter_files  # noqa: PLC0415

        check_adapter_files(settings.lora)
    settings.lora_init_without_apply = args.lora_init_without_apply
    settings.context_shift = args.context_shift
    settings.mmproj = args.mmproj
    if args.mmproj and not os.path.isfile(args.mmproj):   # before listening, in one line
        raise UserError(f"--mmproj {args.mmproj}: no such file")
    if args.mmproj and args.context_shift:    # a shift would cut an image: as llama-server
        log.warning("--context-shift is off with --mmproj (a shift could cut an image)")
        settings.context_shift = False
    cache_ram = args.cache_ram != 0 and not args.embedding
    if cache_ram:
        log.debug("prompt cache on, limit %s", "none" if args.cache_ram < 0
                  else f"{args.cache_ram} MiB")
        if args.cache_idle_slots:      # llama-server's debug line (its tests read it)
            log.debug("idle slots are saved to the prompt cache when a request starts "
                      "(__TEST_TAG_CACHE_IDLE_SLOTS_ENABLED__)")
    capture = None
    if args.write_profile is not None:
        from runtime.commands.trace_record import ProfileCapture  # noqa: PLC0415

        capture = ProfileCapture(args.write_profile)

    def load() -> Engine:
        engine = Engine(settings, progress=True)
        if capture is not None:
            capture.attach(engine, str(model_path))
        if template is not None:
            engine.use_chat_template(template)
        # embeddings: one input at a time; the prompt cache lives in the slot scheduler, one
        # per load (a sleeping model's goes with its engine: host RAM is the experts')
        if (args.parallel > 1 or cache_ram) and not args.embedding:
            from runtime.engine.batched import BatchScheduler  # noqa: PLC0415
            from runtime.engine.prompt_cache import PromptCache  # noqa: PLC0415

            prompt_cache = PromptCache(max(0, args.cache_ram) << 20) if cache_ram else None
            engine.batcher = BatchScheduler(engine, prompt_cache, args.cache_idle_slots,
                                            batch_invariant=args.batch_invariant)
        return engine

    server_settings = ServerSettings(
        model_id=model_id, api_key=edge.api_key, max_waiting=args.queue_size,
        slots_endpoint=args.slots, cors_origins=edge.origins, defaults=defaults,
        parallel=args.parallel, aliases=aliases, verbose=args.verbose,
        reasoning=args.reasoning, reasoning_format=args.reasoning_format,
        metrics_endpoint=args.metrics, embedding=args.embedding, slot_save_path=slot_dir,
        web_ui=args.web_ui, cors_proxy=args.cors_proxy, cors_proxy_allow=edge.proxy_allow,
        limits=edge.limits, threads_http=args.threads_http, mmproj=args.mmproj,
        sleep_idle_seconds=args.sleep_idle_seconds if sleeps(args) else None,
        tags=tuple(t.strip() for t in (args.tags or "").split(",") if t.strip()))
    return ModelServer(server_settings, settings, load, capture)
