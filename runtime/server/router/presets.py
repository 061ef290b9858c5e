"""The models a router serves, as llama-server lists them: ``--models-dir DIR`` (each
``*.gguf`` there is a model named by its file name without ``.gguf``; each subdirectory holding
GGUF files is a model named by the directory: its first shard ``-00001-of-N``, else its one
model file, and the file whose name starts with ``mmproj`` its projector, ``--mmproj``) and
``--models-preset FILE`` (an INI file: one section per model, keys are ``serve``'s long flags
without the dashes, ``[*]`` applies to every model):

    [*]
    ctx-size = 8192

    [qwen3-30b]
    model = /models/Qwen3-30B-A3B-Q4_K_M.gguf
    devices.cpu = 12GiB
    alias = qwen,qwen3
    load-on-startup = true

A name in both is one model: the preset's keys added to the directory's. Keys the router reads
itself: ``alias`` and ``tags`` (comma-separated), ``load-on-startup`` (true: loaded when the
server starts), ``stop-timeout`` (seconds an unload waits for requests in flight, default 10)
and ``version`` (ignored, as llama-server does). Which keys a model may set is checked where
they become flags (runtime.commands.serve_models).
"""
from __future__ import annotations

import configparser
from dataclasses import dataclass, field
from pathlib import Path

from runtime.errors import UserError

GLOBAL_SECTION = "*"
DEFAULT_STOP_TIMEOUT_S = 10.0
ROUTER_KEYS = frozenset({"alias", "tags", "load-on-startup", "stop-timeout", "version"})
TRUE = frozenset({"1", "true", "yes", "on"})
FALSE = frozenset({"0", "false", "no", "off"})


@dataclass(frozen=True)
class ModelSpec:
    """One model of the catalogue: its name and the ``serve`` options it loads with."""

    name: str
    options: tuple[tuple[str, str], ...]    # (flag without dashes, value), later ones win
    source: str                             # "models_dir" | "preset" (llama-server's)
    aliases: tuple[str, ...] = ()
    tags: tuple[str, ...] = ()
    load_on_startup: bool = False
    stop_timeout_s: float = DEFAULT_STOP_TIMEOUT_S
    preset: str = ""                        # where it was written, for messages

    def to_ini(self) -> str:
        """The model's section as INI text (``/models``' ``status.preset``)."""
        return "\n".join([f"[{self.name}]", *(f"{k} = {v}" for k, v in self.options)]) + "\n"


@dataclass
class _Entry:
    options: list[tuple[str, str]] = field(default_factory=list)
    source: str = "preset"
    where: str = ""


def scan_models_dir(path: str) -> dict[str, _Entry]:
    """llama-server's models directory (see the module docstring); UserError when not a
    directory."""
    root = Path(path)
    if not root.is_dir():
        raise UserError(f"--models-dir {path}: does not exist or is not a directory")
    found: dict[str, _Entry] = {}
    for entry in sorted(root.iterdir()):
        if entry.is_dir():
            files = sorted(p for p in entry.iterdir() if p.is_file() and p.suffix == ".gguf")
            projectors = [p for p in files if p.name.lower().startswith("mmproj")]
            ggufs = [p for p in files if p not in projectors]
            shards = [p for p in ggufs if "-00001-of-" in p.name]
            chosen = shards[0] if shards else (ggufs[-1] if ggufs else None)
            if chosen is not None:
                options = [("model", str(chosen))]
                if projectors:                  # the model's projector: images with it
                    options.append(("mmproj", str(projectors[0])))
                found[entry.name] = _Entry(options, "models_dir", str(entry))
        elif entry.is_file() and entry.name.endswith(".gguf"):
            found[entry.name.replace(".gguf", "")] = _Entry([("model", str(entry))],
                                                          "models_dir", str(entry))
    return found


def read_preset(path: str) -> tuple[list[tuple[str, str]], dict[str, _Entry]]:
    """(the ``[*]`` options, each model section's) of an INI preset file; UserError naming
    the file on bad INI."""
    parser = configparser.ConfigParser(delimiters=("=",), interpolation=None, strict=True,
                                       default_section="\x00none")  # [*] is ours, not DEFAULT
    parser.optionxform = str          # keys as written (flag names are case-sensitive)
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) else "not UTF-8 text"
        raise UserError(f"--models-preset {path}: cannot read ({reason})") from None
    try:
        parser.read_string(text, source=path)
    except configparser.Error as exc:
        first = str(exc).splitlines()[0]
        raise UserError(f"--models-preset {path}: not a valid INI file ({first})") from None
    global_options: list[tuple[str, str]] = []
    sections: dict[str, _Entry] = {}
    for name in parser.sections():
        options = [(key.strip(), value.strip()) for key, value in parser.items(name)]
        if name == GLOBAL_SECTION:
            global_options = options
        else:
            sections[name] = _Entry(options, "preset", f"{path}: [{name}]")
    return global_options, sections


def catalogue(models_dir: str | None, preset_path: str | None) -> list[ModelSpec]:
    """Every model of the directory and the preset file, sorted by name; UserError (one line)
    for a bad router key or a name/alias given to two models."""
    entries = scan_models_dir(models_dir) if models_dir else {}
    global_options: list[tuple[str, str]] = []
    if preset_path:
        global_options, sections = read_preset(preset_path)
        for name, entry in sections.items():
            if name in entries:       # merged: the preset's keys after the directory's
                entries[name] = _Entry(entries[name].options + entry.options, "preset",
                                       entry.where)
            else:
                entries[name] = entry
    specs = [_spec(name, global_options + entry.options, entry)
             for name, entry in sorted(entries.items())]
    _check_names(specs)
    return specs


def _spec(name: str, options: list[tuple[str, str]], entry: _Entry) -> ModelSpec:
    router = {k: v for k, v in options if k in ROUTER_KEYS}     # the last one of each wins
    where = entry.where or name
    try:
        stop = float(router.get("stop-timeout", DEFAULT_STOP_TIMEOUT_S))
    except ValueError:
        raise UserError(f"{where}: stop-timeout: {router['stop-timeout']!r} is not a number "
                        "of seconds") from None
    if not 0 <= stop <= 3600:
        raise UserError(f"{where}: stop-timeout: {stop:g} must be in 0..3600 seconds")
    return ModelSpec(name=name, options=tuple((k, v) for k, v in options if k not in ROUTER_KEYS),
                     source=entry.source, aliases=_split(router.get("alias", "")),
                     tags=_split(router.get("tags", "")),
                     load_on_startup=truthy(router.get("load-on-startup", "false"),
                                            f"{where}: load-on-startup"),
                     stop_timeout_s=stop, preset=where)


def truthy(value: str, where: str) -> bool:
    """An INI boolean; UserError naming ``where`` otherwise."""
    low = value.strip().lower()
    if low in TRUE or low in FALSE:
        return low in TRUE
    raise UserError(f"{where}: {value!r} is not true or false")


def _split(text: str) -> tuple[str, ...]:
    return tuple(dict.fromkeys(p.strip() for p in text.split(",") if p.strip()))


def _check_names(specs: list[ModelSpec]) -> None:
    """llama-server's rule: a name or an alias names one model only."""
    owner: dict[str, str] = {}
    for spec in specs:
        for name in (spec.name, *spec.aliases):
            if name in owner and owner[name] != spec.name:
                raise UserError(f"{spec.preset}: the name {name!r} is already model "
                                f"{owner[name]!r}'s")
            owner[name] = spec.name
