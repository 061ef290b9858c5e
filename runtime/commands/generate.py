"""``moe-offload complete`` and ``moe-offload chat``: llama.cpp-style text generation.

    moe-offload complete -m MODEL -p PROMPT [-n N] [--temp T] ...   # text on stdout only
    moe-offload chat -m MODEL [--system TEXT]                       # multi-turn; /exit ends

stdout carries only generated text; the loading bar, errors and the closing timings line
(prompt t/s, generation t/s, expert hit rate) go to stderr. In chat, Ctrl-C stops the reply
being written (the program goes on); Ctrl-C or Ctrl-D at the prompt ends it. Piped stdin
works: each line is one user turn.
"""
from __future__ import annotations

import argparse
import contextlib
import signal
import sys
import threading
from pathlib import Path

from runtime.errors import UserError



def register(subparsers: argparse._SubParsersAction) -> None:
    from runtime.commands.engine_args import HelpFormatter as _FMT  # noqa: PLC0415
    from runtime.commands.engine_args import (add_engine_args, add_route_trace_arg,  # noqa: PLC0415
                                              add_sampling_args)
    from runtime.engine.stats_file import add_stats_json_arg  # noqa: PLC0415

    comp = subparsers.add_parser(
        "complete", help="complete a prompt (text to stdout)", formatter_class=_FMT,
        description="Continue PROMPT with the model, streaming only the generated text to "
                    "stdout; timings and expert hit rate go to stderr.")
    src = comp.add_mutually_exclusive_group()
    src.add_argument("-p", "--prompt", help="prompt text (required unless --route-trace)")
    src.add_argument("-f", "--file", metavar="FILE", help="read the prompt from FILE")
    comp.add_argument("-sys", "--system-prompt", dest="system", default=None, metavar="TEXT",
                      help="a system message: the prompt is then rendered with the model's "
                           "chat template as one user turn (llama.cpp's -sys)")
    add_engine_args(comp)
    add_route_trace_arg(comp)
    add_sampling_args(comp)
    add_stats_json_arg(comp)
    comp.set_defaults(func=run_complete)

    chat = subparsers.add_parser(
        "chat", help="chat with a model in the terminal", formatter_class=_FMT,
        description="Multi-turn chat using the model's chat template, with line editing and "
                    "history. /help lists the commands (/exit quits, /reset forgets the "
                    "conversation); Ctrl-C stops the current reply.")
    chat.add_argument("-sys", "--system-prompt", "--system", dest="system", default=None,
                      metavar="TEXT", help="system message")
    add_engine_args(chat)
    add_sampling_args(chat, predict_default=512)
    chat.set_defaults(func=run_chat)


def _prompt_text(args: argparse.Namespace) -> str | None:
    if args.prompt is not None:
        return args.prompt
    if args.file is None:
        return None
    try:
        return Path(args.file).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise UserError(f"{args.file}: no such file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise UserError(f"{args.file}: cannot read ({exc})") from None


@contextlib.contextmanager
def _engine_errors(model: str):
    """A failure inside generation (llama_decode, a routing observer) is one line, not a
    traceback."""
    try:
        yield
    except UserError:
        raise
    except RuntimeError as exc:
        raise UserError(f"{model}: generation failed: {exc}") from exc


def _write(text: str) -> None:
    if text:
        sys.stdout.write(text)
        sys.stdout.flush()


def run_complete(args: argparse.Namespace) -> int:
    """Stream one completion to stdout; the timings line to stderr."""
    from runtime.commands.engine_args import sampling_from_args, settings_from_args  # noqa: PLC0415
    from runtime.engine.hook.imposed_routing import imposed_request  # noqa: PLC0415
    from runtime.engine.engine import Engine  # noqa: PLC0415
    from runtime.engine.stats_file import check_stats_json_path, write_stats_json  # noqa: PLC0415

    prompt = _prompt_text(args)
    if prompt is None and args.route_trace is None:
        raise UserError("give a prompt: -p TEXT or -f FILE (or --route-trace TRACE)")
    params = sampling_from_args(args)
    check_stats_json_path(args.stats_json)
    note = None
    settings = settings_from_args(args)
    with _engine_errors(settings.model_path), Engine(settings) as engine:
        prompt, params = imposed_request(engine, prompt, params, args)
        note = engine.imposed.note() if engine.imposed is not None else None
        if args.system is not None and isinstance(prompt, str):
            prompt = engine.chat_prompt([{"role": "system", "content": args.system},
                                         {"role": "user", "content": prompt}])
        last, tail = None, ""
        for chunk in engine.generate(prompt, params):
            _write(chunk.text)
            tail = chunk.text[-1:] or tail
            last = chunk
        write_stats_json(args.stats_json, engine)
    if tail != "\n":       # a file or pipe gets whole lines; a terminal a clean prompt
        _write("\n")
    if last is not None and last.timings is not None:
        sys.stderr.write(last.timings.summary() + (f" | {note}" if note else "") + "\n")
    return 0


@contextlib.contextmanager
def _sigint_sets(event: threading.Event):
    """While inside: Ctrl-C sets ``event`` instead of raising KeyboardInterrupt."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, lambda *_: event.set())
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


CHAT_HELP = """commands:
  /help    this list
  /reset   forget the conversation (the system message stays)
  /exit    quit (also Ctrl-D, or Ctrl-C at the prompt)
Ctrl-C while a reply is written stops that reply. Up/down arrows recall earlier lines."""


def _line_editing() -> None:
    """Line editing and history at the ``>`` prompt (readline, when Python has it)."""
    try:
        import readline  # noqa: F401, PLC0415 - importing it makes input() use it
    except ImportError:
        pass


def _read_turn(interactive: bool) -> str | None:
    """The next user line; None at end of input (Ctrl-D, Ctrl-C, end of the pipe)."""
    try:
        if interactive:
            if sys.stdout.isatty():     # readline draws the prompt (editing, history)
                return input("\n> ")
            sys.stderr.write("\n> ")   # stdout is a file: it carries replies only
            sys.stderr.flush()
            return input()
        line = sys.stdin.readline()
    except (KeyboardInterrupt, EOFError):
        return None
    return None if line == "" else line.rstrip("\n")


def _chat_command(line: str) -> str | None:
    """What a ``/command`` line means: "exit", "reset", "help", or None for a message.
    An unknown command is answered here, never sent to the model."""
    word = line.strip()
    if not word.startswith("/") or word.startswith("//"):
        return None
    name = word.split()[0]
    if name in ("/exit", "/quit", "/bye"):
        return "exit"
    if name in ("/reset", "/clear"):
        return "reset"
    if name in ("/help", "/?"):
        return "help"
    return "unknown"


def run_chat(args: argparse.Namespace) -> int:
    """The chat loop: history, /exit, /reset, Ctrl-C stops a reply."""
    from runtime.commands.engine_args import sampling_from_args, settings_from_args  # noqa: PLC0415
    from runtime.engine.engine import Engine  # noqa: PLC0415
    from runtime.engine.types import ContextLengthError, Timings  # noqa: PLC0415

    params = sampling_from_args(args)
    interactive = sys.stdin.isatty()
    system = [{"role": "system", "content": args.system}] if args.system else []
    totals: list[Timings] = []
    settings = settings_from_args(args)
    with _engine_errors(settings.model_path), Engine(settings) as engine:
        if interactive:
            sys.stderr.write(f"{engine.model_name}: chat ready. /help lists the commands; "
                             "/exit quits, Ctrl-C stops a reply.\n")
        messages = list(system)
        if interactive:
            _line_editing()
        while True:
            line = _read_turn(interactive)
            command = None if line is None else _chat_command(line)
            if line is None or command == "exit":
                break
            if command == "reset":
                messages = list(system)
                sys.stderr.write("(conversation forgotten)\n")
                continue
            if command in ("help", "unknown"):
                if command == "unknown":
                    sys.stderr.write(f"unknown command {line.strip().split()[0]}; "
                                     "start a message with // to send a leading /\n")
                sys.stderr.write(CHAT_HELP + "\n")
                continue
            if line.startswith("//"):
                line = line[1:]
            if not line.strip():
                continue
            messages.append({"role": "user", "content": line})
            try:
                reply, timings = _reply(engine, messages, params)
            except ContextLengthError as exc:
                sys.stderr.write(f"moe-offload: {exc}; conversation reset\n")
                messages = list(system)
                continue
            messages.append({"role": "assistant", "content": reply})
            if timings is not None:
                totals.append(timings)
    if interactive:
        sys.stderr.write("\n")
    if totals:
        sys.stderr.write(_sum_timings(totals).summary() + "\n")
    return 0


def _reply(engine, messages: list[dict[str, str]], params):
    """Stream one assistant reply to stdout; Ctrl-C ends it early. (reply text, timings)"""
    cancel = threading.Event()
    parts: list[str] = []
    timings = None
    with _sigint_sets(cancel):
        for chunk in engine.generate(engine.chat_prompt(messages), params, cancel=cancel):
            _write(chunk.text)
            parts.append(chunk.text)
            timings = chunk.timings or timings
    _write("\n")
    return "".join(parts), timings


def _sum_timings(items):
    from runtime.engine.types import Timings  # noqa: PLC0415

    hits = [t.expert_hits for t in items if t.expert_hits is not None]
    accesses = [t.expert_accesses for t in items if t.expert_accesses is not None]
    return Timings(prompt_tokens=sum(t.prompt_tokens for t in items),
                   prompt_s=sum(t.prompt_s for t in items),
                   completion_tokens=sum(t.completion_tokens for t in items),
                   generation_s=sum(t.generation_s for t in items),
                   expert_hits=sum(hits) if hits else None,
                   expert_accesses=sum(accesses) if accesses else None)
