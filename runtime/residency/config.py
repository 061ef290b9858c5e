"""Residency configuration: a TOML file (tomllib) plus command-line overrides.

See docs/design/contracts.md ("Residency") for the file format. Every error is one line that
names the file (or the command line) and the key: ``"cfg.toml: devices.cuda:0: not a size"``.
"""
from __future__ import annotations

import copy
import re
import tomllib
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Mapping

from runtime.device_names import parse_rpc_device
from runtime.errors import UserError
from runtime.residency.policies.factory import (ROLES, PolicySpec, make_spec, param_defaults,
                                               param_names, policy_names)
from runtime.residency.types import Phase
from runtime.units import parse_percent, parse_size

DEVICE_RE = re.compile(r"^(cpu|cpu-slots|(cuda|vulkan):(0|[1-9][0-9]*))$")
GPU_KINDS = ("cuda", "vulkan")     # cuda:N, vulkan:N: the Nth GPU of that ggml backend
# "auto" budgets: the share of the device's free (RAM: available) memory at load
AUTO_SHARE = {"cuda": 0.80, "vulkan": 0.80, "cpu": 0.50, "cpu-slots": 0.25, "rpc": 0.80}
RPC_MODES = ("auto", "layers", "experts", "llama", "cache")   # runtime/rpc/plan.py


def device_kind(device: str) -> str:
    """"cuda" for cuda:N, "vulkan" for vulkan:N, "rpc" for rpc:HOST:PORT[/N], else the
    device name itself."""
    kind = device.split(":", 1)[0]
    return kind if kind in GPU_KINDS or kind == "rpc" else device


def is_gpu(device: str) -> bool:
    """cuda:N or vulkan:N."""
    return device_kind(device) in GPU_KINDS


def is_cache_device(device: str) -> bool:
    """A device the device cache serves: a GPU, cpu-slots (host slots, same code), or a
    remote one (rpc:HOST:PORT[/N]; managed only with ``[rpc] mode = "cache"``)."""
    return is_gpu(device) or device == "cpu-slots" or device.startswith("rpc:")


@dataclass(frozen=True)
class DeviceBudget:
    """One device's expert budget: fixed bytes, or a share of free memory resolved at load."""

    device: str
    text: str                  # as written, for messages
    bytes: int | None = None   # fixed budget
    share: float | None = None # share of free memory (auto: AUTO_SHARE)
    auto: bool = False


@dataclass(frozen=True)
class PhasePolicies:
    admission: PolicySpec = PolicySpec("always")
    prefetch: PolicySpec = PolicySpec("none")
    eviction: PolicySpec = PolicySpec("lru")


@dataclass(frozen=True)
class CostParams:
    """Inputs of the replay cost model. Defaults: PCIe 4.0 x16 and dual-channel DDR5."""

    link_gbps: float = 25.0        # host->GPU effective copy rate, GB/s (1e9 B/s)
    link_latency_us: float = 10.0  # fixed cost per transfer, µs
    storage_gbps: float = 2.0      # file -> host RAM page-in rate, GB/s
    cpu_mem_gbps: float = 60.0     # CPU expert compute in place, weight bytes streamed, GB/s
    cpu_gflops: float = 400.0      # CPU expert matmul rate (prefill, compute-bound), GFLOP/s
    gpu_mem_gbps: float = 900.0    # GPU expert compute, weight bytes streamed, GB/s
    gpu_gflops: float = 50000.0    # GPU expert matmul rate, GFLOP/s


COST_KEYS = tuple(f.name for f in fields(CostParams))
_ZERO_OK_COST = {"link_latency_us"}


@dataclass(frozen=True)
class ResidencyConfig:
    devices: tuple[DeviceBudget, ...] = ()
    phase_specific: bool = True
    prefill: PhasePolicies = PhasePolicies(prefetch=PolicySpec("chunk-plan", (("depth", 1.0),)))
    # decode: eviction next-visit (beats lru in every cell of the real traces: docs/replay-matrix.md)
    decode: PhasePolicies = PhasePolicies(eviction=make_spec("eviction", "next-visit"))
    cost: CostParams = field(default_factory=CostParams)
    source: str = "<defaults>"
    # remote devices (rpc:HOST:PORT[/N]): planned by runtime/rpc/plan.py; with rpc_mode
    # "cache" they are in ``devices`` too (the manager fills the device cache's slots there)
    remotes: tuple[DeviceBudget, ...] = ()
    rpc_mode: str = "auto"             # [rpc] mode: auto | layers | experts | llama | cache
    rpc_timeout_s: float = 20.0        # [rpc] timeout_s: a link silent this long is down

    def policies_for(self, phase: Phase) -> PhasePolicies:
        """The policies serving ``phase``: MIXED and phase_specific=false use decode's."""
        if self.phase_specific and phase == Phase.PREFILL:
            return self.prefill
        return self.decode

    def budget(self, device: str) -> DeviceBudget:
        """The configured budget of ``device``; "auto" when the file names none."""
        for b in self.devices:
            if b.device == device:
                return b
        return DeviceBudget(device, "auto", share=AUTO_SHARE.get(device_kind(device), 0.5),
                            auto=True)


def parse_budget(device: str, value: object, where: str) -> DeviceBudget:
    """One ``[devices]`` entry; UserError naming ``where`` on a bad value."""
    if device.startswith("rpc:"):
        device = parse_rpc_device(device, where).name       # canonical: rpc:host:port[/N]
    elif not DEVICE_RE.match(device):
        raise UserError(f"{where}: unknown device {device!r} (valid: cuda:N, vulkan:N, cpu, "
                        "cpu-slots, rpc:HOST:PORT[/N])")
    if isinstance(value, str) and value.strip().lower() == "auto":
        return DeviceBudget(device, "auto", share=AUTO_SHARE[device_kind(device)], auto=True)
    try:
        share = parse_percent(value) if isinstance(value, str) else None
        if share is not None:
            return DeviceBudget(device, str(value), share=share)
        if isinstance(value, float):
            raise ValueError("use an integer number of bytes or a string with units, "
                             f"got {value!r}")
        return DeviceBudget(device, str(value), bytes=parse_size(value))
    except ValueError as err:
        raise UserError(f"{where}: {err}") from None


def _table(data: Mapping, key: str, where: str) -> Mapping:
    value = data.get(key, {})
    if not isinstance(value, Mapping):
        raise UserError(f"{where}: {key} must be a table")
    return value


def _phase_policies(data: Mapping, phase: str, source: str, base: PhasePolicies) -> PhasePolicies:
    where = f"{source}: policy.{phase}"
    allowed = set(ROLES) | {f"{r}_params" for r in ROLES}
    for key in data:
        if key not in allowed:
            raise UserError(f"{where}.{key}: unknown key (valid: {', '.join(sorted(allowed))})")
    specs = {}
    for role in ROLES:
        spec = getattr(base, role)
        name = data.get(role, spec.name)
        params = data.get(f"{role}_params")
        if params is not None and not isinstance(params, Mapping):
            raise UserError(f"{where}.{role}_params: must be a table")
        if params is None and name == spec.name:
            params = spec.kwargs()
        specs[role] = make_spec(role, name, dict(params or {}), where=f"{where}.{role}")
    return PhasePolicies(**specs)


def parse_config(data: Mapping, *, source: str = "<config>") -> ResidencyConfig:
    """A ResidencyConfig from parsed TOML; UserError "SOURCE: key: problem" on bad input."""
    base = ResidencyConfig()
    for key in data:
        if key not in ("devices", "policy", "cost", "rpc"):
            raise UserError(f"{source}: {key}: unknown section (valid: devices, policy, cost, rpc)")
    devices, remotes = [], []
    for device, value in _table(data, "devices", source).items():
        budget = parse_budget(str(device), value, f"{source}: devices.{device}")
        if any(b.device == budget.device for b in devices + remotes):
            raise UserError(f"{source}: devices.{device}: {budget.device} is named twice")
        (remotes if budget.device.startswith("rpc:") else devices).append(budget)
    rpc = _table(data, "rpc", source)
    for key in rpc:
        if key not in ("mode", "timeout_s"):
            raise UserError(f"{source}: rpc.{key}: unknown key (valid: mode, timeout_s)")
    rpc_mode = rpc.get("mode", base.rpc_mode)
    if rpc_mode not in RPC_MODES:
        raise UserError(f"{source}: rpc.mode: {rpc_mode!r} is not one of {', '.join(RPC_MODES)}")
    rpc_timeout = rpc.get("timeout_s", base.rpc_timeout_s)
    if isinstance(rpc_timeout, bool) or not isinstance(rpc_timeout, (int, float)) \
            or not 0 < rpc_timeout <= 3600:
        raise UserError(f"{source}: rpc.timeout_s: must be a number of seconds in (0, 3600], "
                        f"got {rpc_timeout!r}")
    policy = _table(data, "policy", source)
    for key in policy:
        if key not in ("phase_specific", "prefill", "decode"):
            raise UserError(f"{source}: policy.{key}: unknown key "
                            "(valid: phase_specific, prefill, decode)")
    phase_specific = policy.get("phase_specific", base.phase_specific)
    if not isinstance(phase_specific, bool):
        raise UserError(f"{source}: policy.phase_specific: must be true or false, "
                        f"got {phase_specific!r}")
    prefill = _phase_policies(_table(policy, "prefill", f"{source}: policy"), "prefill", source,
                              base.prefill)
    decode = _phase_policies(_table(policy, "decode", f"{source}: policy"), "decode", source,
                             base.decode)
    cost_values = {}
    for key, value in _table(data, "cost", source).items():
        if key not in COST_KEYS:
            raise UserError(f"{source}: cost.{key}: unknown key (valid: {', '.join(COST_KEYS)})")
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise UserError(f"{source}: cost.{key}: must be a number, got {value!r}")
        if value < 0 or (value == 0 and key not in _ZERO_OK_COST) or value != value:
            raise UserError(f"{source}: cost.{key}: must be > 0, got {value!r}")
        cost_values[key] = float(value)
    if rpc_mode == "cache":          # the remotes hold device-cache slots: managed devices
        if len(remotes) > 1 or (remotes and any(is_cache_device(b.device) for b in devices)):
            raise UserError(f"{source}: rpc.mode = \"cache\": the device cache serves "
                            "one device per model; name one rpc device and no cuda/vulkan/"
                            "cpu-slots device")
        devices = devices + remotes
    return ResidencyConfig(devices=tuple(devices), phase_specific=phase_specific,
                           prefill=prefill, decode=decode, cost=CostParams(**cost_values),
                           source=source, remotes=tuple(remotes), rpc_mode=rpc_mode,
                           rpc_timeout_s=float(rpc_timeout))


def read_toml(path: str | Path) -> dict:
    """The parsed TOML file; UserError for a missing file or bad TOML."""
    p = Path(path)
    try:
        raw = p.read_bytes()
    except FileNotFoundError:
        raise UserError(f"{path}: no such file") from None
    except IsADirectoryError:
        raise UserError(f"{path}: is a directory, not a TOML file") from None
    except OSError as err:
        raise UserError(f"{path}: cannot read ({err.strerror})") from None
    try:
        return tomllib.loads(raw.decode("utf-8"))
    except UnicodeDecodeError:
        raise UserError(f"{path}: not a TOML file (not UTF-8 text)") from None
    except tomllib.TOMLDecodeError as err:
        raise UserError(f"{path}: not valid TOML: {err}") from None


def load_config(path: str | Path | None, *,
                overrides: Mapping[str, str] | None = None) -> ResidencyConfig:
    """The config in ``path`` (None: defaults) with dotted-key ``overrides`` applied on top."""
    data = read_toml(path) if path is not None else {}
    source = str(path) if path is not None else "<defaults>"
    if overrides:
        data = apply_overrides(data, overrides)
        source = f"{source} + command line" if path is not None else "command line"
    return parse_config(data, source=source)


def preset_config(policy: str) -> ResidencyConfig:
    """replay's ``--policy NAME``: eviction NAME under demand admission, no prefetch.

    ``belady`` is eviction belady with admission belady-bypass (the offline optimum with
    bypass); ``belady-forced`` is eviction belady with admission always.
    """
    if policy == "belady":
        phase = PhasePolicies(admission=PolicySpec("belady-bypass"), eviction=PolicySpec("belady"))
    elif policy == "belady-forced":
        phase = PhasePolicies(eviction=PolicySpec("belady"))
    else:
        from runtime.residency.policies.factory import param_defaults, policy_names
        if policy not in policy_names("eviction"):
            valid = ", ".join((*policy_names("eviction"), "belady-forced"))
            raise UserError(f"unknown policy {policy!r} (valid: {valid})")
        phase = PhasePolicies(eviction=make_spec("eviction", policy,
                                                 param_defaults("eviction", policy)))
    return ResidencyConfig(phase_specific=False, prefill=phase, decode=phase,
                           source=f"--policy {policy}")


# -- dotted-key overrides (the command line's config flags) -------------------------------
MAX_CUDA_FLAGS = 16


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
