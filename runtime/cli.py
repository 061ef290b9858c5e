"""The ``moe-offload`` console command: one entry point, subcommands registered by modules.

Each module in ``COMMAND_MODULES`` exposes ``register(subparsers)`` which adds its subparser(s)
and sets ``func`` (a callable taking the parsed ``argparse.Namespace`` and returning an exit
code) with ``parser.set_defaults(func=...)``. A ``UserError`` raised anywhere becomes one line
on stderr and a non-zero exit; never a traceback.
"""
from __future__ import annotations

import _thread
import argparse
import importlib
import os
import re
import signal
import sys
import time

from runtime.errors import UserError
from runtime.version import version_line

COMMAND_MODULES = [
    "runtime.commands.inspect",
    "runtime.commands.synth",
    "runtime.commands.config",
    "runtime.commands.trace",
    "runtime.commands.replay",
    "runtime.commands.profile",
    "runtime.commands.plan",
    "runtime.commands.generate",
    "runtime.commands.serve",
    "runtime.commands.native",
    "runtime.commands.rpc_server",
    "runtime.commands.bench",
    "runtime.commands.calibrate",
    "runtime.commands.demo",
]


class _Parser(argparse.ArgumentParser):
    """argparse without abbreviations (``--ctx`` is not ``--ctx-size``), and errors in one line;
    a llama.cpp flag this command does not take is named with our equivalent."""

    def __init__(self, *args, **kwargs) -> None:
        from runtime.commands.engine_args import HelpFormatter  # noqa: PLC0415

        kwargs["allow_abbrev"] = False
        if kwargs.get("formatter_class") in (None, argparse.HelpFormatter,
                                             argparse.ArgumentDefaultsHelpFormatter):
            kwargs["formatter_class"] = HelpFormatter     # no "(default: None)", no ``markup``
        super().__init__(*args, **kwargs)

    def parse_known_args(self, args=None, namespace=None):
        from runtime.engine.llama_flags import equivalent_line  # noqa: PLC0415

        argv = list(sys.argv[1:] if args is None else args)
        line = equivalent_line(argv, self._known_flags(argv)) or self._sibling_flag(argv) \
            or self._glued_flag(argv)
        if line:                                                   # -ctk as -c tk
            self.error(line)
        return super().parse_known_args(args, namespace)

    def _sibling_flag(self, argv: list[str]) -> str:
        """A subcommand given another subcommand's flag (``serve -sys``, ``complete -np``):
        name the commands it belongs to (``commands``: set by ``build_parser``)."""
        commands: dict[str, argparse.ArgumentParser] = getattr(self, "commands", {})
        known = self._known_flags(argv) if commands else set()     # a sub-subcommand's too
        for token in argv:
            if token == "--":
                break
            flag = token.split("=", 1)[0]
            if (not token.startswith("-") or flag in known
                    or self._negative_number_matcher.match(token)):
                continue
            owners = {name: p for name, p in commands.items()
                      if p is not self and flag in p._option_string_actions}
            if owners:
                action = next(iter(owners.values()))._option_string_actions[flag]
                what = re.split(r"[;:(]", action.help or "")[0].strip()
                names = list(owners)
                names = ", ".join(names[:-1]) + " and " + names[-1] if len(names) > 1 \
                    else names[0]
                here = self.prog.removeprefix("moe-offload ")
                return (f"{flag} is a flag of moe-offload {names}"
                        f"{f' ({what})' if what else ''}, not of {here}")
        return ""

    def _known_flags(self, argv: list[str]) -> set[str]:
        """This parser's option strings and those of the subcommands ``argv`` chooses (a
        command's own ``-j`` or ``--rpc`` is not llama.cpp's)."""
        known = set(self._option_string_actions)
        actions = self._subparsers._group_actions if self._subparsers is not None else []
        for action in actions:
            if not isinstance(action, argparse._SubParsersAction):
                continue
            for at, token in enumerate(argv):
                sub = action.choices.get(token)
                if sub is not None and isinstance(sub, _Parser):
                    known |= sub._known_flags(argv[at + 1:])
                    break
        return known

    def _glued_flag(self, argv: list[str]) -> str:
        """llama.cpp's tools take no value glued to a short flag: ``-sys`` is not ``-s ys``,
        nor ``-c512`` ``-c 512``. argparse would read them so (allow_abbrev does not stop it):
        here such a token is an unknown flag, in one line."""
        for token in argv:
            if token == "--" or (self._subparsers is not None and not token.startswith("-")):
                break            # the rest is the subcommand's to check
            flag = token.split("=", 1)[0]
            if (token.startswith("-") and not token.startswith("--") and len(flag) > 2
                    and " " not in token and flag not in self._option_string_actions
                    and not self._negative_number_matcher.match(token)
                    and token[:2] in self._option_string_actions):
                return (f"unrecognized argument {flag} (not {token[:2]} {token[2:]!r}: "
                        "a short flag's value goes after a space)")
        return ""

    def error(self, message: str) -> None:  # one line, exit 2, like argparse but without usage spam
        sys.stderr.write(f"{self.prog}: error: {message}\n")
        sys.exit(2)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="moe-offload",
        description="Run mixture-of-experts GGUF models with managed expert residency.",
    )
    parser.add_argument("--version", action="version", version=version_line())
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    for name in COMMAND_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:  # during development a command may not exist yet
            if exc.name == name:
                continue
            raise
        module.register(sub)
    for command in sub.choices.values():    # each knows the others: a flag of another is named
        command.commands = sub.choices
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run one command; Ctrl-C at any point (imports included) is ``moe-offload: interrupted``
    and exit status 130, never a traceback."""
    sys.unraisablehook = _redeliver_lost_interrupt
    try:
        parser = build_parser()
        args = parser.parse_args(argv)
        if not getattr(args, "func", None):
            parser.print_help(sys.stderr)
            return 2
        return int(args.func(args) or 0)
    except UserError as err:
        sys.stderr.write(f"moe-offload: error: {err}\n")
        return err.exit_code
    except KeyboardInterrupt:
        return _interrupted()
    except BrokenPipeError:
        return 0


def _redeliver_lost_interrupt(unraisable, _default=sys.unraisablehook) -> None:
    """``sys.unraisablehook``: a Ctrl-C whose KeyboardInterrupt was raised where Python ignores
    exceptions (a weakref callback of the import system, llama.cpp's log callback) is
    delivered again, to be raised where it ends the command (seen: a run that went on to
    finish its 1,500 tokens and exit 0 after such a Ctrl-C, once in 50 under load). From
    another thread, a moment later: raised in here, it would be lost again."""
    if unraisable.exc_type is not None and issubclass(unraisable.exc_type, KeyboardInterrupt):
        _thread.start_new_thread(_interrupt_main_soon, ())
        return
    _default(unraisable)


def _interrupt_main_soon() -> None:
    time.sleep(0.001)
    _thread.interrupt_main(signal.SIGINT)


def _interrupted() -> int:
    try:
        sys.stderr.write("moe-offload: interrupted\n")
        sys.stderr.flush()
    except (OSError, ValueError):
        pass
    return 130


def run() -> None:
    """The console script (and ``python -m runtime.cli``): exit with ``main()``'s status.
    After Ctrl-C the process ends right there, output flushed, without the interpreter's
    shutdown: on a loaded machine CPython was seen to end such a run by SIGINT (status -2)
    after ``main`` had returned 130 and said so."""
    code = main()
    if code == 130:
        signal.signal(signal.SIGINT, signal.SIG_IGN)   # a second Ctrl-C: nothing to print
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        os._exit(130)
    sys.exit(code)


if __name__ == "__main__":
    run()
