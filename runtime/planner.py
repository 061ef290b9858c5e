"""Automatic placement: a residency config from a model file and the machine's free memory.

``plan(model, memory, ctx)`` splits each device's free memory into what the model needs
besides experts (dense weights, the KV cache, a reserve for compute buffers and the OS) and
an expert budget, fastest device first:

* with a GPU: the dense weights and the KV cache go to the GPU (``-ngl 99``), the rest of its
  free memory (less GPU_RESERVE) holds experts (the device cache); host RAM (less
  RAM_RESERVE) keeps the experts the GPU does not hold (the RAM tier), the rest stays on
  storage;
* without one: dense weights and the KV cache stay in RAM, the rest of the available RAM
  (less RAM_RESERVE) holds experts; the others page from the file.

Remote devices (``rpc:HOST:PORT[/N]``, ``plan --rpc``) that answer a short probe get a budget
of RPC_SHARE of the free memory they report, and ``[rpc] mode = "auto"`` (runtime/rpc/plan.py
chooses whole layers or expert tensors at load; the plan that choice gives at this context is
written as a comment). An unreachable remote is left out, with a note saying why.

A budget it cannot meet (the dense weights and KV cache alone exceed the free memory) is a
UserError, one line. The TOML it renders explains each number in a comment and names the
policies (next-visit eviction, affinity prefetch in decode).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from runtime.errors import UserError
from runtime.units import format_size

_REPO_ROOT = str(Path(__file__).resolve().parents[2])   # the package's root, for the child

GIB = 1 << 30
RAM_RESERVE = GIB          # bytes: the OS, Python, llama.cpp's host buffers
# A RAM budget below every expert now also holds the RAM tier's one-use room (every expert of
# one layer: a prompt's layer-step reads them for one use, runtime/ramtier split_budget). Those
# reads always sat in RAM beside the kept experts; before they were bounded by the budget they
# were in what the reserve left (case a, docs/benchmarks/2026-12-07-realscale.md: peak 6.98 GiB
# under an 8 GiB limit with a 6.02 GiB budget). So the room comes out of the reserve, up to
# this share of it, and the experts kept stay as they were.
RESERVE_FOR_ONE_USE = 0.5
GPU_RESERVE = GIB // 2     # bytes: compute buffers, the cache's staging
RPC_SHARE = 0.80           # of a remote's reported free memory (its "auto" budget)


@dataclass(frozen=True)
class DeviceMemory:
    device: str            # "cuda:0", "vulkan:0", "cpu"
    free_bytes: int
    total_bytes: int


@dataclass(frozen=True)
class PlannedDevice:
    device: str
    budget_bytes: int      # expert bytes this device keeps
    why: str               # one comment line


@dataclass(frozen=True)
class Plan:
    model: str
    devices: tuple[PlannedDevice, ...]
    gpu_layers: int        # -ngl to run with
    notes: tuple[str, ...]
    remotes: tuple[PlannedDevice, ...] = ()

    def chosen(self) -> list[str]:
        """What ``--auto`` chose, one line per device and one for -ngl (shown at load)."""
        lines = [f"--auto: --devices.{d.device} {d.budget_bytes}B ({format_size(d.budget_bytes)}"
                 f" of experts): {d.why}" for d in self.devices + self.remotes]
        return lines + [f"--auto: -ngl {self.gpu_layers}"]

    def to_toml(self) -> str:
        lines = [f"# moe-offload plan for {self.model}"]
        lines += [f"# {n}" for n in self.notes]
        lines += [f"# run with: -ngl {self.gpu_layers} --config THIS_FILE", "", "[devices]"]
        for d in self.devices + self.remotes:
            lines += [f"# {d.why}", f'"{d.device}" = "{d.budget_bytes}B"   '
                      f"# {format_size(d.budget_bytes)}"]
        if self.remotes:
            lines += ["", "[rpc]", "# whole remote layers or expert tensors only, by the link "
                      "cost model at load", 'mode = "auto"']
        lines += ["", "[policy.decode]",
                  "# learned next-use estimate (docs/replay-matrix.md): fewer demand misses than lru",
                  'eviction = "next-visit"',
                  "# cross-layer prefetch of the likeliest followers not resident (calibrated q >= "
                  "min_precision), only while the link carries them in time",
                  'prefetch = "affinity"', ""]
        return "\n".join(lines)


def plan(facts, memory: list[DeviceMemory], *, ctx: int, kv_per_token: int) -> Plan:
    """The placement for ``facts`` (ModelFacts) on devices with ``memory`` (a "cpu" entry
    required; GPUs optional, fastest first)."""
    ram = next((m for m in memory if m.device == "cpu"), None)
    if ram is None:
        raise UserError("host RAM could not be measured (psutil reported nothing)")
    gpus = [m for m in memory if m.device != "cpu"]
    dense, experts = facts.dense_bytes, facts.total_expert_bytes
    kv = kv_per_token * ctx
    need = f"dense weights {format_size(dense)} + KV cache {format_size(kv)} (ctx {ctx})"
    notes = [f"{facts.n_layer} layers, {facts.n_expert} experts x {len(facts.moe_layers)} MoE "
             f"layers, expert bytes {format_size(experts)}, dense {format_size(dense)}"]
    devices: list[PlannedDevice] = []
    left = experts                                  # expert bytes not yet placed
    if gpus:
        gpu = gpus[0]
        room = gpu.free_bytes - dense - kv - GPU_RESERVE
        if room < 0:
            raise UserError(f"{facts.path}: {need} need {format_size(dense + kv + GPU_RESERVE)}"
                            f" on {gpu.device} with its reserve, only "
                            f"{format_size(gpu.free_bytes)} free")
        budget = min(room, experts)
        devices.append(PlannedDevice(gpu.device, budget, (
            f"{gpu.device}: {format_size(gpu.free_bytes)} free - {need} - reserve "
            f"{format_size(GPU_RESERVE)} = {format_size(room)} for experts")))
        left -= budget
        ram_room = ram.free_bytes - RAM_RESERVE
        if left > 0 and ram_room > 0:
            budget, lent = _with_one_use_room(facts, ram_room)
            devices.append(PlannedDevice("cpu", budget, (
                f"cpu: {format_size(ram.free_bytes)} available - reserve "
                f"{format_size(RAM_RESERVE)}{lent}: experts kept in RAM (the rest page from the "
                "file)")))
        gpu_layers = 99
    else:
        room = ram.free_bytes - dense - kv - RAM_RESERVE
        if room <= 0:
            raise UserError(f"{facts.path}: {need} need "
                            f"{format_size(dense + kv + RAM_RESERVE)} of RAM with its "
                            f"reserve, only {format_size(ram.free_bytes)} available")
        budget, lent = _with_one_use_room(facts, room)
        rest = ("every expert fits" if budget == experts else
                f"{format_size(experts - budget)} of experts page from the file")
        devices.append(PlannedDevice("cpu", budget, (
            f"cpu: {format_size(ram.free_bytes)} available - {need} - reserve "
            f"{format_size(RAM_RESERVE)}{lent} = {format_size(budget)}: {rest}")))
        gpu_layers = 0
        notes.append("no GPU: experts in RAM, the rest on storage")
    return Plan(model=facts.path, devices=tuple(devices), gpu_layers=gpu_layers,
                notes=tuple(notes))


def _with_one_use_room(facts, room: int) -> tuple[int, str]:
    """(the RAM budget for ``room`` bytes left for experts, the words saying what the reserve
    lent): below every expert the budget holds the tier's one-use room too, lent by the
    reserve (RESERVE_FOR_ONE_USE), so the experts kept are ``room`` as before."""
    from runtime.ramtier import one_use_room  # noqa: PLC0415 - (cffi; only for a plan)

    experts = facts.total_expert_bytes
    if room >= experts:
        return experts, ""
    lent = min(one_use_room(facts)[0], int(RAM_RESERVE * RESERVE_FOR_ONE_USE))
    return min(room + lent, experts), f" + {format_size(lent)} of it for one layer's one-use reads"


# In a child: which GPUs ggml sees, with the library a GPU would be used through (a CUDA or
# Vulkan build when one is built, else this install's). Printed as JSON.
_GPU_PROBE = """
import json
from runtime.native import ggml_lib, llama_lib, preferred_lib_dir
llama_lib.select_library_dir(preferred_lib_dir({"cuda:0"}) or preferred_lib_dir({"vulkan:0"})
                             or preferred_lib_dir())
print(json.dumps([(d.name, d.free_bytes, d.total_bytes) for d in ggml_lib.devices()
                  if d.kind != ggml_lib.GGML_BACKEND_DEVICE_TYPE_CPU]))
"""
GPU_PROBE_TIMEOUT_S = 120


def probe_gpus() -> list[tuple[str, int, int]]:
    """(ggml name, free, total bytes) of every GPU, [] when none can be used. Probed in a child
    process: loading llama.cpp here would fix this process's library before the engine picks
    its own (the patched build the budgets need: `--auto` plans, then loads)."""
    try:
        done = subprocess.run([sys.executable, "-c", _GPU_PROBE], capture_output=True,
                              text=True, timeout=GPU_PROBE_TIMEOUT_S,
                              env=os.environ | {"PYTHONPATH": _REPO_ROOT + os.pathsep
                                                + os.environ.get("PYTHONPATH", "")})
        return [tuple(d) for d in json.loads(done.stdout.strip().splitlines()[-1])] \
            if done.returncode == 0 else []
    except (subprocess.TimeoutExpired, ValueError, IndexError, OSError):
        return []               # no usable ggml library: plan for RAM and storage


def measured_memory(stated: dict[str, int]) -> list:
    """Every device's (free, total) memory, GPUs first; ``stated`` wins over measurement."""
    from runtime.residency.capacity import probe_device_memory  # noqa: PLC0415

    out = []
    gpus = [d for d in stated if d != "cpu"]
    if not gpus and "cpu" not in stated:
        out += [DeviceMemory(f"cuda:{i}" if "CUDA" in name.upper() else f"vulkan:{i}",
                             free, total) for i, (name, free, total) in enumerate(probe_gpus())]
    out += [DeviceMemory(d, stated[d], stated[d]) for d in gpus]
    if "cpu" in stated:
        out.append(DeviceMemory("cpu", stated["cpu"], stated["cpu"]))
    else:
        mem = probe_device_memory("cpu")
        if mem is not None:
            out.append(DeviceMemory("cpu", *mem))
    return out


def plan_remotes(facts, path: str, ctx: int, remotes: list[str], *, warn=None
                 ) -> tuple[tuple[PlannedDevice, ...], tuple[str, ...]]:
    """Budgets for the reachable ``remotes`` (rpc:HOST:PORT[/N]) and the notes: the remote
    plan they give at ``ctx``, and the remotes left out (also passed to ``warn``)."""
    import dataclasses  # noqa: PLC0415

    from runtime.engine.types import EngineSettings  # noqa: PLC0415
    from runtime.residency.config import ResidencyConfig, parse_budget  # noqa: PLC0415
    from runtime.device_names import parse_rpc_device  # noqa: PLC0415
    from runtime.rpc.probe import RemoteUnreachable, probe  # noqa: PLC0415
    from runtime.rpc.setup import PROBE_TIMEOUT_S, plan_for  # noqa: PLC0415

    planned, notes, resolved = [], [], []
    for text in remotes:
        dev = parse_rpc_device(text if text.startswith("rpc:") else f"rpc:{text}", "--rpc")
        try:
            info = probe(dev, timeout=PROBE_TIMEOUT_S)
        except RemoteUnreachable as err:
            notes.append(f"left out: {err}")
            if warn is not None:
                warn(f"moe-offload: note: {err}; left out of the plan")
            continue
        budget = int(info.free_bytes * RPC_SHARE)
        planned.append(PlannedDevice(dev.name, budget, (
            f"{dev.name}: {format_size(info.free_bytes)} free reported, "
            f"{RPC_SHARE:.0%} of it (round trip {info.rtt_s * 1e3:.2f} ms)")))
        resolved.append((parse_budget(dev.name, f"{budget}B", "plan"), dev, info, budget))
    if resolved:
        config = dataclasses.replace(ResidencyConfig(), remotes=tuple(b for b, *_ in resolved))
        settings = EngineSettings(model_path=path, n_ctx=ctx)
        notes.append(f"at load, at -c {ctx}: "
                     f"{plan_for(config, facts, settings, resolved).describe()}")
    return tuple(planned), tuple(notes)


def plan_model(path: str, ctx: int, stated: dict[str, int] | None = None,
               remotes: list[str] | None = None, *, warn=None) -> Plan:
    """The plan for the model file at ``path`` on this machine (``stated``: free bytes per
    device that replace measurement; ``remotes``: rpc devices to include when reachable)."""
    import dataclasses  # noqa: PLC0415

    from gguf_tools.facts import read_model_facts  # noqa: PLC0415

    if ctx <= 0:
        raise UserError(f"-c: the context size must be positive, got {ctx}")
    facts = read_model_facts(path)
    result = plan(facts, measured_memory(stated or {}), ctx=ctx,
                  kv_per_token=facts.kv_bytes_per_token)
    if not remotes:
        return result
    planned, notes = plan_remotes(facts, path, ctx, remotes, warn=warn)
    return dataclasses.replace(result, remotes=planned, notes=result.notes + notes)
