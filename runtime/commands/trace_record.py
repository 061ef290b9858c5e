"""``moe-offload trace record``: run a model and write every routing decision to a trace.

    moe-offload trace record -m MODEL.gguf (-p PROMPT | -f FILE) [-n N] [--chat] [--temp T] -o OUT
        [--config FILE | --devices.cpu-slots 2MB ...] [--no-residency] [--stats-json FILE]
        [--write-profile PROFILE]

Every prompt token of every MoE layer is captured (logits are requested for every prompt
token, so even the last layer routes them all) and every generated token is tagged decode.
The run takes every placement flag ``complete`` takes: with a residency config the manager
and its tiers run as in ``complete`` while the routes are recorded, and the trace header
carries the pools (layers and capacities) of the fastest managed device, so that
``moe-offload replay TRACE --capacity recorded`` replays the same decisions;
``--stats-json FILE`` writes the manager's final snapshot (the JSON of ``GET /v1/residency``);
``--write-profile PROFILE`` the routing profile of the recorded decode tokens (as
``moe-offload profile OUT -o PROFILE``).
With ``--chat`` the prompt goes through the model's chat template; with ``--chat -f FILE``
each non-empty line of FILE is one user turn, answered before the next (trace column
``turn``). OUT ending in ``.csv`` is route_trace v1 CSV, anything else the binary format.
The file appears only when the recording finished (an error leaves nothing behind).
"""
from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable
from pathlib import Path

from runtime.atomic_write import scratch_path
from runtime.engine.hook.events import RouteEvent
from runtime.engine.stats_file import add_stats_json_arg, check_stats_json_path, write_stats_json
from runtime.engine.types import Fault
from runtime.errors import UserError
from runtime.residency.types import Phase

log = logging.getLogger("moe_offload.server")


class TraceRecorder:
    """A RouteObserver that appends each batch's events to a ``TraceWriter``.

    ``on_failure``: None, a write that fails (disk full) is raised into the decode (``trace
    record`` stops with it); else the recorder stops instead: the writer is discarded,
    ``failure`` says why, ``on_failure(failure)`` is called once and every later batch is
    dropped (``serve --write-profile``: the server goes on serving)."""

    synchronous = False    # it only writes at the batch's end: the native hook may buffer

    def __init__(self, writer, on_failure: Callable[[str], None] | None = None):
        self.writer = writer
        self._pending: list[RouteEvent] = []
        self.tokens = {Phase.PREFILL: 0, Phase.DECODE: 0}
        self._on_failure = on_failure
        self.failure: str | None = None     # why the recorder stopped (None: recording)

    def on_route(self, event: RouteEvent) -> None:
        self._pending.append(event)     # written after the decode call, off the graph's path

    def on_batch_end(self, phase: Phase, n_tokens: int) -> None:
        pending, self._pending = self._pending, []
        if self.failure is not None:
            return
        try:
            for e in pending:
                self.writer.append_batch(turn=e.turn, phase=int(e.phase), layer=e.layer,
                                         first_step=e.first_step, experts=e.experts,
                                         weights=e.weights)
        except (UserError, OSError) as exc:   # the writer's one line for ENOSPC, EFBIG ...
            if self._on_failure is None:
                raise
            self.writer.abort()             # its scratch files go: the space comes back
            self.failure = str(exc)
            self._on_failure(self.failure)
            return
        self.tokens[Phase(phase)] = self.tokens.get(Phase(phase), 0) + n_tokens


class ProfileCapture:
    """A running engine's routing, kept to write a routing profile when it stops (``serve
    --write-profile``): the trace goes to a scratch file beside the profile, which
    ``finish()`` turns into the profile (the same ``build_profile`` as ``moe-offload
    profile``) and removes."""

    def __init__(self, target: str | Path):
        self.target = Path(target)
        if not self.target.parent.is_dir():
            raise UserError(f"{self.target}: directory {self.target.parent} does not exist")
        # the routing trace the profile is built from; named as the profile's temp files, so
        # a killed server's scratch trace is removed by the profile's next writer
        self._scratch = scratch_path(self.target, "routing.rtb")
        self._writer = None
        self.recorder: TraceRecorder | None = None

    def attach(self, engine, model_path: str) -> None:
        """Record ``engine``'s routing from now on (call once, before it generates)."""
        from runtime.traces.model_header import header_from_model  # noqa: PLC0415
        from runtime.traces.writer import TraceWriter  # noqa: PLC0415

        self._writer = TraceWriter(self._scratch, header_from_model(model_path))
        self.recorder = TraceRecorder(self._writer, on_failure=self._stopped)
        engine.add_route_observer(self.recorder)
        engine.add_fault_source(self.fault)

    def _stopped(self, why: str) -> None:
        log.error("%s: the routing profile stopped recording (%s); serving goes on, and no "
                  "profile is written at exit", self.target, why)

    def fault(self) -> Fault | None:
        """The recorder's state for /health: a Fault once it stopped."""
        if self.recorder is None or self.recorder.failure is None:
            return None
        return Fault("profile_writer", f"{self.target}: stopped recording the routing "
                     f"profile ({self.recorder.failure})", serving=True)

    def finish(self) -> str:
        """Write the profile (after the engine stopped); what happened, in one line."""
        from runtime.residency.profile import build_profile, write_profile  # noqa: PLC0415
        from runtime.traces.files import read_trace  # noqa: PLC0415

        if self._writer is None:
            return f"{self.target}: not written (the model never loaded)"
        if self.recorder.failure is not None:
            return f"{self.target}: not written (recording stopped: {self.recorder.failure})"
        tokens = self.recorder.tokens[Phase.DECODE]
        if tokens == 0:
            self._writer.abort()
            return f"{self.target}: not written (no token was generated)"
        try:
            self._writer.close()
            write_profile(self.target, build_profile([read_trace(self._scratch)],
                                                     names=[str(self.target)]))
        except UserError as exc:
            return f"{self.target}: not written ({exc})"
        finally:
            self._scratch.unlink(missing_ok=True)
        return f"routing profile of {tokens} generated tokens -> {self.target}"


def register_record(trace_subparsers: argparse._SubParsersAction) -> None:
    """Add ``record`` under ``moe-offload trace``."""
    from runtime.commands.engine_args import (HelpFormatter, add_engine_args,  # noqa: PLC0415
                                              add_route_trace_arg, add_sampling_args)

    p = trace_subparsers.add_parser(
        "record", help="run a model and record its routing to a trace",
        formatter_class=HelpFormatter,
        description="Run MODEL on a prompt and write every routed (token, layer, slot) with "
                    "its phase, step and turn to OUT (.csv: route_trace v1 CSV, else binary).")
    src = p.add_mutually_exclusive_group()
    src.add_argument("-p", "--prompt", help="prompt text (required unless --route-trace)")
    src.add_argument("-f", "--file", metavar="FILE",
                     help="prompt file (with --chat: one user turn per non-empty line)")
    p.add_argument("-o", "--output", required=True, metavar="OUT", help="trace file to write")
    p.add_argument("--chat", action="store_true",
                   help="wrap the prompt(s) in the model's chat template")
    add_engine_args(p, residency=True)
    add_route_trace_arg(p)
    add_sampling_args(p, predict_default=64)
    add_stats_json_arg(p)
    p.add_argument("--write-profile", metavar="PROFILE", default=None,
                   help="also write the routing profile of the recorded decode tokens (as "
                        "`moe-offload profile OUT -o PROFILE`)")
    p.set_defaults(func=run_record)


def _turns(args: argparse.Namespace) -> list[str | None]:
    if args.prompt is not None:
        return [args.prompt]
    if args.file is None:
        if args.route_trace is None:
            raise UserError("give a prompt: -p TEXT or -f FILE (or --route-trace TRACE)")
        return [None]                   # the trace's own prompt length
    try:
        text = Path(args.file).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise UserError(f"{args.file}: no such file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise UserError(f"{args.file}: cannot read ({exc})") from None
    turns = [line.strip() for line in text.splitlines() if line.strip()] if args.chat else [text]
    if not turns or not any(turns):
        raise UserError(f"{args.file}: empty prompt file")
    return turns


def run_record(args: argparse.Namespace) -> int:
    from runtime.commands.engine_args import sampling_from_args, settings_from_args  # noqa: PLC0415
    from runtime.engine.hook.imposed_routing import imposed_request  # noqa: PLC0415
    from runtime.engine.engine import Engine  # noqa: PLC0415
    from runtime.traces.model_header import header_from_model  # noqa: PLC0415
    from runtime.traces.writer import TraceWriter  # noqa: PLC0415

    turns = _turns(args)
    params = sampling_from_args(args)
    settings = settings_from_args(args)
    # every prompt token of every layer, unless an imposed trace itself holds only the
    # prompt's outputs at the last MoE layer (llama.cpp's default): then as that trace did
    settings.route_trace = _imposed(settings)          # read once; the engine takes it as is
    settings.capture_all_tokens = settings.route_trace is None or \
        settings.route_trace.all_prompt_rows
    out = Path(args.output)
    if not out.parent.is_dir():
        raise UserError(f"{out}: directory {out.parent} does not exist")
    check_stats_json_path(args.stats_json)
    header = header_from_model(settings.model_path)
    with Engine(settings, progress=True) as engine:
        header = with_recorded_pools(header, engine)
        with TraceWriter(out, header) as writer:
            recorder = TraceRecorder(writer)
            engine.add_route_observer(recorder)
            messages: list[dict[str, str]] = []
            for text in turns:
                if args.chat and text is not None:
                    messages.append({"role": "user", "content": text})
                    prompt = engine.chat_prompt(messages)
                else:
                    prompt = text
                prompt, turn_params = imposed_request(engine, prompt, params, args)
                reply = "".join(chunk.text for chunk in engine.generate(prompt, turn_params))
                messages.append({"role": "assistant", "content": reply})
            rows = writer.rows_written
        write_stats_json(args.stats_json, engine)
    note = f"; {engine.imposed.note()}" if engine.imposed is not None else ""
    sys.stderr.write(f"recorded {rows} routing rows ({recorder.tokens[Phase.PREFILL]} prompt + "
                     f"{recorder.tokens[Phase.DECODE]} generated tokens, {len(turns)} turn(s)) "
                     f"to {out}{note}\n")
    if args.write_profile:
        from runtime.residency.profile import build_profile, write_profile  # noqa: PLC0415
        from runtime.traces.files import read_trace  # noqa: PLC0415

        write_profile(args.write_profile, build_profile([read_trace(out)], names=[str(out)]))
        sys.stderr.write(f"profile of its decode tokens -> {args.write_profile}\n")
    return 0


def _imposed(settings):
    """The settings' imposed routing, loaded (None without --route-trace)."""
    if settings.route_trace is None:
        return None
    from gguf_tools.facts import read_model_facts  # noqa: PLC0415
    from runtime.engine.engine import check_model_path  # noqa: PLC0415
    from runtime.engine.hook.imposed_routing import imposed_for  # noqa: PLC0415

    check_model_path(settings.model_path)
    return imposed_for(settings.route_trace, read_model_facts(settings.model_path))


def with_recorded_pools(header, engine):
    """``header`` with the pools of the engine's fastest managed device (none without a
    manager or with an unresolved device)."""
    from dataclasses import replace  # noqa: PLC0415

    from runtime.traces.trace import TracePool  # noqa: PLC0415

    manager = engine.manager
    if manager is None or not engine.residency_devices:
        return header
    pools = manager.pools(engine.residency_devices[0])
    if any(p.capacity_bytes < 0 for p in pools):
        return header
    return replace(header, pools=tuple(TracePool(p.layers, p.capacity_bytes) for p in pools))

