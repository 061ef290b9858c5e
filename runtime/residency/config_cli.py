"""Every config key as a command-line flag of the same dotted name, merged over the file.

``--devices.cuda:0 6GiB``, ``--policy.phase_specific false``, ``--policy.decode.eviction lfu``,
``--policy.decode.eviction_params.half_life 2048``, ``--cost.link_gbps 12``. Flags win.
"""
from __future__ import annotations

import argparse

from runtime.residency.config import (ResidencyConfig, apply_overrides, config_keys, load_config,
                                      parse_config)
from runtime.residency.policies.factory import policy_names

_DEST_PREFIX = "residency_cfg__"
SHORT_HELP_KEYS = ("devices.cpu", "devices.cuda:0")   # in --help; the rest in --help-all


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
            where = "the free RAM" if key in ("devices.cpu", "devices.cpu-slots") else \
                f"the free memory of {key.removeprefix('devices.')}"
            helptext, metavar = f"budget: size with units (16GiB), N%% of {where}, or auto", \
                "SIZE"
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

    data = tomllib.loads(text)
    overrides = overrides_from_args(args)
    if overrides:
        data = apply_overrides(data, overrides)
    return parse_config(data, source=source)
