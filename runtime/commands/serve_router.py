"""``serve --models-dir DIR | --models-preset FILE``: router mode, several models, one process.

Each model's flags are its preset's (``[*]`` first, then its own section; a models-dir entry
is ``model = FILE``), parsed with ``serve``'s own parser; the flags given to the router on
the command line then win, as llama-server's do, except those that belong to the whole
server (address, key, CORS, the chat page, the router's own flags) and the residency
budgets: ``--devices.X`` / ``--config``'s devices are the pools that the models' reservations
come out of (runtime/server/router/budgets.py says the rule). A model's own ``devices.X`` in
its preset is what it asks of the pool (a size, or N% of the pool); without one it asks the
pool / ``--models-max``.

Nothing of a model file is read at start (its flags are checked and its path stat'ed); a model
loads, lazily as with ``-m``, when a request or ``POST /models/load`` names it.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import threading
from typing import Any

from runtime.commands.serve_model import Edge, model_server
from runtime.errors import UserError

# serve flags that belong to the whole server: not per model, not passed on to the models
SERVER_DESTS = frozenset({"host", "port", "api_key", "models_dir", "models_preset",
                          "models_max", "models_autoload", "cors_origin", "web_ui",
                          "cors_proxy", "ui_mcp_proxy_allow"})
# a model's identity: set in its preset (or by the router), never overlaid from the CLI
MODEL_DESTS = frozenset({"model", "hf_repo", "hf_file", "alias", "tags"})
REFUSED_DESTS = frozenset({"write_profile", "auto", "help", "help_all", "list_devices",
                           "version"})
DEVICE_DEST_PREFIX = "residency_cfg__devices__"


class _PresetParser(argparse.ArgumentParser):
    """``serve``'s parser for a preset's flags: errors are UserErrors naming the preset."""

    where = "preset"

    def error(self, message: str):
        raise UserError(f"{self.where}: {message}")


def serve_parser() -> _PresetParser:
    from runtime.commands.serve_flags import add_serve_args  # noqa: PLC0415

    parser = _PresetParser(prog="moe-offload serve", add_help=False)
    add_serve_args(parser)
    return parser


def option_argv(parser: argparse.ArgumentParser, key: str, value: str, where: str) -> list[str]:
    """A preset's ``key = value`` as ``serve`` flags (a switch: ``true`` gives it, ``false``
    its opposite, if any); UserError for a key that is no flag or is the server's."""
    from runtime.server.router.presets import truthy  # noqa: PLC0415

    flag = next((f for f in (f"--{key}", f"-{key}") if f in parser._option_string_actions),
                None)  # noqa: SLF001 - argparse has no public lookup
    if flag is None:
        raise UserError(f"{where}: option '{key}' not recognized (keys are serve's flags "
                        "without their dashes)")
    action = parser._option_string_actions[flag]  # noqa: SLF001
    if action.dest in SERVER_DESTS or action.dest in REFUSED_DESTS \
            or action.dest in ("alias", "tags"):
        raise UserError(f"{where}: {key}: not a per-model option (give it to the router on "
                        "the command line)" if action.dest in SERVER_DESTS else
                        f"{where}: {key}: not available in router mode")
    if action.nargs != 0:
        return [flag, value]
    if truthy(value, f"{where}: {key}"):
        return [flag]
    opposite = next((a for a in parser._actions if a.dest == action.dest  # noqa: SLF001
                     and a is not action and a.nargs == 0 and a.option_strings), None)
    return [opposite.option_strings[0]] if opposite is not None else []


def given_flags(parser: argparse.ArgumentParser, args: argparse.Namespace
                ) -> dict[str, Any]:
    """The router's command-line values that differ from ``serve``'s defaults and pass on to
    every model (dest -> value)."""
    out = {}
    for action in parser._actions:  # noqa: SLF001
        dest = action.dest
        if dest in SERVER_DESTS or dest in MODEL_DESTS or dest in REFUSED_DESTS \
                or dest.startswith(DEVICE_DEST_PREFIX) or not hasattr(args, dest):
            continue
        value = getattr(args, dest)
        if value != parser.get_default(dest):
            out[dest] = value
    return out


def _render(parser: argparse.ArgumentParser, given: dict[str, Any]) -> list[str]:
    """``given`` as flags again (``/models``' status.args)."""
    out: list[str] = []
    for dest, value in given.items():
        action = next(a for a in parser._actions if a.dest == dest and a.option_strings  # noqa: SLF001
                      and (a.nargs != 0 or a.const == value))
        flag = action.option_strings[-1]
        if action.nargs == 0:
            out.append(flag)
        else:
            out += [x for v in (value if isinstance(value, list) else [value])
                    for x in (flag, str(v))]
    return out


class ModelLauncher:
    """Turns a catalogue entry into a Launch (its app, not started): ``prepare(spec)``."""

    def __init__(self, args: argparse.Namespace, edge: Edge, pools: dict[str, int],
                 default_share: float) -> None:
        self.parser = serve_parser()
        self.given = given_flags(self.parser, args)
        self.edge = edge
        self.pools = pools
        self.default_share = default_share    # of each pool, for a model that asks nothing
        self._parsing = threading.Lock()      # the parser names the preset in its errors

    def own_argv(self, spec) -> list[str]:
        """The model's preset as flags; UserError for a bad key."""
        argv: list[str] = []
        for key, value in spec.options:
            argv += option_argv(self.parser, key, value, spec.preset)
        return argv

    def parse(self, spec, argv: list[str]) -> argparse.Namespace:
        with self._parsing:             # loads and a reload parse on worker threads
            self.parser.where = spec.preset
            args = self.parser.parse_args(argv)
        if not args.model and not args.hf_repo:
            raise UserError(f"{spec.preset}: no model (model = FILE or hf-repo = USER/MODEL)")
        return args

    def check(self, spec) -> None:
        """At start: the preset's flags parse and its file exists (nothing is read)."""
        args = self.parse(spec, self.own_argv(spec))
        if args.model and not os.path.isfile(args.model):
            raise UserError(f"{spec.preset}: model {args.model}: no such file")

    def asks(self, spec, own: argparse.Namespace) -> dict[str, Any]:
        """What the model's own preset asks of each pool (budgets.Ask per pooled device)."""
        from runtime.residency.config_cli import config_from_args  # noqa: PLC0415
        from runtime.server.router.budgets import Ask  # noqa: PLC0415

        config = config_from_args(own) if not own.no_residency else None
        asked = {b.device: b for b in (config.devices if config is not None else ())}
        out = {}
        for device in self.pools:
            b = asked.get(device)
            out[device] = Ask(device) if b is None or b.auto else \
                Ask(device, bytes=b.bytes, share=b.share)
        return out

    def prepare(self, spec):
        """The model's Launch: its app (``edge=False``) with fixed budgets for the pooled
        devices, its flags, its reservation. Blocking (reads the GGUF header only)."""
        from runtime.residency.config import DeviceBudget  # noqa: PLC0415
        from runtime.server.app import create_app  # noqa: PLC0415
        from runtime.server.router.instance import Launch  # noqa: PLC0415

        own_argv = self.own_argv(spec)
        own = self.parse(spec, own_argv)
        asks = self.asks(spec, own)
        args = self.parse(spec, own_argv)
        for dest, value in self.given.items():
            setattr(args, dest, value)
        server = model_server(args, self.edge, model_id=spec.name, aliases=spec.aliases)
        wants: dict[str, int] = {}
        config = server.engine_settings.config
        if config is not None and self.pools:
            wants = {d: a.resolve(self.pools[d], self.default_share) for d, a in asks.items()}
            fixed = [DeviceBudget(d, f"{n} bytes of the server's {d} budget", bytes=n)
                     for d, n in wants.items()]
            server.engine_settings.config = dataclasses.replace(
                config, devices=tuple(b for b in config.devices if b.device not in wants)
                + tuple(fixed))
        app = create_app(server.settings, server.load, edge=False)
        return Launch(app, tuple(["serve", *own_argv, *_render(self.parser, self.given)]),
                      wants)


def resolve_pools(args: argparse.Namespace) -> dict[str, int]:
    """The router's own budgets, in bytes now (a share of the memory free at start)."""
    from runtime.residency.capacity import probe_device_memory, resolve_budget  # noqa: PLC0415
    from runtime.residency.config_cli import config_from_args  # noqa: PLC0415

    if args.no_residency:
        return {}
    config = config_from_args(args)
    pools = {}
    for budget in config.devices:
        memory = probe_device_memory(budget.device)
        free, total = memory if memory is not None else (None, None)
        pools[budget.device] = resolve_budget(budget, free_bytes=free, total_bytes=total,
                                              source=config.source)
    return pools


def router_app(args: argparse.Namespace, edge: Edge):
    """The router's app over the catalogue (every preset checked, no model loaded)."""
    from runtime.server.app import ServerSettings  # noqa: PLC0415
    from runtime.server.router.budgets import BudgetPool  # noqa: PLC0415
    from runtime.server.router.models import ModelRouter  # noqa: PLC0415
    from runtime.server.router.presets import catalogue  # noqa: PLC0415
    from runtime.server.router.routes import create_router_app  # noqa: PLC0415

    for dest, flag in (("write_profile", "--write-profile"), ("auto", "--auto"),
                       ("alias", "--alias"), ("tags", "--tags"), ("mmproj", "--mmproj")):
        if getattr(args, dest, None):
            raise UserError(f"{flag}: not in router mode" + (
                f" (per model: {dest} = {'FILE' if dest == 'mmproj' else 'A,B'} in its "
                "--models-preset section)" if dest in ("alias", "tags", "mmproj") else ""))
    if args.models_max < 0:
        raise UserError(f"--models-max: {args.models_max} must be >= 0 (0: no limit)")
    specs = catalogue(args.models_dir, args.models_preset)
    if not specs:
        raise UserError("router mode: no model found (no .gguf in --models-dir, no section in "
                        "--models-preset)")
    startup = [s.name for s in specs if s.load_on_startup]
    if 0 < args.models_max < len(startup):
        raise UserError(f"{len(startup)} models have load-on-startup, more than --models-max "
                        f"{args.models_max}")
    pools = resolve_pools(args)
    share = 1.0 / (args.models_max or len(specs))
    launcher = ModelLauncher(args, edge, pools, share)

    def read_catalogue() -> list:
        """The catalogue, every preset checked (at start, and on GET /models?reload)."""
        fresh = catalogue(args.models_dir, args.models_preset)
        for spec in fresh:
            launcher.check(spec)
        return fresh

    for spec in specs:
        launcher.check(spec)
    router = ModelRouter(specs, prepare=launcher.prepare, pool=BudgetPool(pools),
                         models_max=args.models_max, autoload=args.models_autoload,
                         catalogue=read_catalogue)
    settings = ServerSettings(model_id="moe-offload", api_key=edge.api_key,
                              cors_origins=edge.origins, limits=edge.limits,
                              web_ui=args.web_ui, cors_proxy=args.cors_proxy,
                              cors_proxy_allow=edge.proxy_allow, metrics_endpoint=args.metrics)
    return create_router_app(settings, router)
