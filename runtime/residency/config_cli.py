"""Every config key as a command-line flag of the same dotted name, merged over the file.

``--devices.cuda:0 6GiB``, ``--policy.phase_specific false``, ``--policy.decode.eviction lfu``,
``--policy.decode.eviction_params.half_life 2048``, ``--cost.link_gbps 12``. Flags win.
"""
from __future__ import annotations

import argparse
import copy
from typing import Mapping

from runtime.errors import UserError
from runtime.residency.config import COST_KEYS, ResidencyConfig, load_config
from runtime.residency.policies.factory import ROLES, param_defaults, param_names, policy_names

MAX_CUDA_FLAGS = 16
_DEST_PREFIX = "residency_cfg__"
SHORT_HELP_KEYS = ("devices.cpu", "devices.cuda:0")   # in --help; the rest in --help-all


def config_keys() -> dict[str, str]:
    """Every settable dotted key -> its kind ("size", "bool", "name:<role>", "number")."""
    keys: dict[str, str] = {}
    for device in ("cpu", "cpu-slots", *(f"{kind}:{i}" for kind in ("cuda", "vulkan")
                                         for i in range(MAX_CUDA_FLAGS))):
        keys[f"devices.{device}"] = "size"
    keys["policy.phase_specific"] = "bool"
    for phase in ("prefill", "decode"):
        for role in ROLES:
            keys[f"policy.{phase}.{role}"] = f"name:{role}"
            for param in param_names(role):
                keys[f"policy.{phase}.{role}_params.{param}"] = "number"
    for key in COST_KEYS:
        keys[f"cost.{key}"] = "number"
    return keys


def _dest(key: str) -> str:
    return _DEST_PREFIX + key.replace(".", "__").replace(":", "_").replace("-", "_")


def add_config_arguments(parser: argparse.ArgumentParser, *, config_file_flag: bool = True) -> None:
    """Add ``--config FILE`` (optional) and one flag per config key to ``parser``; the keys
    past ``SHORT_HELP_KEYS`` are listed by ``--help-all`` only (``advanced_help``)."""
    n_more = len([k for k in config_keys() if k not in SHORT_HELP_KEYS and not _hidden(k)])
    group = parser.add_argument_group(
        "residency config", "any key of the residency TOML, as a flag of the same dotted name; "
        f"flags override the file. --help-all lists {n_more} more (policies, costs, devices)")
    parser.add_argument("--help-all", action=HelpAll,
                        help="show every flag, the advanced residency keys too, and exit")
    if config_file_flag:
        group.add_argument("--config", metavar="FILE", default=None,
                           help="residency config TOML (default: built-in defaults)")
    for key, kind in config_keys().items():
        if kind == "size":
            helptext, metavar = "budget: size with units, N%% of free memory, or auto", "SIZE"
        elif kind == "bool":
            helptext, metavar = "true or false", "BOOL"
        elif kind.startswith("name:"):
            role = kind.split(":", 1)[1]
            helptext, metavar = ", ".join(policy_names(role)), "NAME"
        else:
            helptext, metavar = "number", "X"
        advanced = key not in SHORT_HELP_KEYS and not _hidden(key)
        action = group.add_argument(f"--{key}", dest=_dest(key), metavar=metavar, default=None,
                                    help=argparse.SUPPRESS if advanced or _hidden(key)
                                    else helptext)
        if advanced:
            action.advanced_help = helptext


def _hidden(key: str) -> bool:
    """cuda:1.. and vulkan:1..: taken, never listed (the config file is the place for them)."""
    return (key.startswith(("devices.cuda:", "devices.vulkan:"))
            and key not in ("devices.cuda:0", "devices.vulkan:0"))


class HelpAll(argparse.Action):
    """``--help-all``: ``--help`` with the advanced residency keys listed too."""

    def __init__(self, option_strings, dest, **kwargs):
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        for action in parser._actions:  # noqa: SLF001 - argparse has no public accessor
            advanced = getattr(action, "advanced_help", None)
            if advanced is not None:
                action.help = advanced
        parser.print_help()
        parser.exit(0)


def overrides_from_args(args: argparse.Namespace) -> dict[str, str]:
    """The dotted keys given on the command line, with their string values."""
    out = {}
    for key in config_keys():
        value = getattr(args, _dest(key), None)
        if value is not None:
            out[key] = value
    return out


def config_from_args(args: argparse.Namespace, *, path: str | None = None) -> ResidencyConfig:
    """The config from ``--config`` (or ``path``) with every given flag merged over it."""
    file = path if path is not None else getattr(args, "config", None)
    return load_config(file, overrides=overrides_from_args(args))


def config_from_text(text: str, args: argparse.Namespace, *, source: str) -> ResidencyConfig:
    """A config from TOML text (``--auto``'s plan) with every given flag merged over it."""
    import tomllib  # noqa: PLC0415

    from runtime.residency.config import parse_config  # noqa: PLC0415

    data = tomllib.loads(text)
    overrides = overrides_from_args(args)
    if overrides:
        data = apply_overrides(data, overrides)
    return parse_config(data, source=source)


def _convert(key: str, kind: str, value: str) -> object:
    if kind == "bool":
        low = value.strip().lower()
        if low in ("true", "1", "yes", "on"):
            return True
        if low in ("false", "0", "no", "off"):
            return False
        raise UserError(f"--{key}: must be true or false, got {value!r}")
    if kind == "number":
        try:
            return float(value)
        except ValueError:
            raise UserError(f"--{key}: must be a number, got {value!r}") from None
    return value


def apply_overrides(data: Mapping, overrides: Mapping[str, str]) -> dict:
    """A copy of parsed TOML ``data`` with dotted-key string ``overrides`` set (typed)."""
    known = config_keys()
    out = copy.deepcopy(dict(data))
    for key, value in overrides.items():
        kind = known.get(key)
        if kind is None:
            raise UserError(f"--{key}: unknown config key")
        parts = key.split(".")
        if parts[0] == "devices":
            parts = ["devices", key[len("devices."):]]
        node = out
        for part in parts[:-1]:
            child = node.get(part)
            if not isinstance(child, dict):
                child = dict(child) if isinstance(child, Mapping) else {}
                node[part] = child
            node = child
        node[parts[-1]] = _convert(key, kind, value)
    # a policy renamed on the command line drops the file's parameters it does not take
    for key, kind in known.items():
        if not kind.startswith("name:") or key not in overrides:
            continue
        _, phase, role = key.split(".")
        table = out.get("policy", {}).get(phase, {})
        params = table.get(f"{role}_params")
        name = table.get(role)
        if isinstance(params, Mapping) and name in policy_names(role):
            accepted = param_defaults(role, name)
            table[f"{role}_params"] = {
                p: v for p, v in params.items()
                if p in accepted or f"{key}_params.{p}" in overrides}
    return out
