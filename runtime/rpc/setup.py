"""Remote devices at load: probe each, resolve its budget, plan, register with ggml, and turn
the plan into llama.cpp's load parameters (devices, tensor_split, n_gpu_layers, overrides).

    remote = setup_remotes(config, facts, settings)     # before llama_model_load_from_file
    params: remote.devices, remote.tensor_split, remote.n_gpu_layers, remote.rules
    remote.check()                                      # after each decode: RemoteDeviceLost
"""
from __future__ import annotations

import ctypes
import re
import sys
from dataclasses import dataclass, field

from runtime.errors import UserError
from runtime.rpc import backend
from runtime.device_names import parse_rpc_device
from runtime.rpc.plan import LayerBytes, Link, RemotePlan, plan_remotes
from runtime.rpc.probe import RemoteInfo, probe

_EXPS = re.compile(r"^blk\.(\d+)\.ffn_(up|down|gate|gate_up)_(ch|)exps")
_BLK = re.compile(r"^blk\.(\d+)\.")
PROBE_TIMEOUT_S = 3.0
PROBE_BANDWIDTH_BYTES = 4 << 20
_BUFFER_LINE = re.compile(r"RPC(\d+)\[([^\]]+)\]\s+(model|KV|compute) buffer size =\s+([\d.]+) MiB")


class RemoteDeviceLost(UserError):
    """A remote device's link failed: the model cannot run until it is reloaded. (A UserError:
    the CLI prints its one line; the server answers 503 remote_device_down.)"""

    exit_code = 1

    def __init__(self, devices: list[str]):
        self.devices = devices
        super().__init__(f"{', '.join(devices)}: remote device lost (connection closed or "
                         "timed out); requests fail until the model is reloaded (restart once "
                         "the rpc-server is back)")


@dataclass
class RemoteSetup:
    """The remotes of one loaded model: the plan, ggml's handles, the load parameters."""

    plan: RemotePlan
    infos: tuple[RemoteInfo, ...]
    handles: tuple[backend.RemoteHandle, ...]
    n_gpu_layers: int | None                 # None: the settings' own
    rules: tuple[tuple[str, int], ...]       # (pattern, buft), placed before the others
    devices: object = None                   # ctypes NULL-terminated ggml_backend_dev_t array
    tensor_split: object = None              # ctypes float[llama_max_devices()]
    lost: list[str] = field(default_factory=list)
    allocated: dict[str, int] = field(default_factory=dict)   # device -> bytes llama.cpp put there
    _failures_seen: int = 0

    def verify_buffers(self, lines) -> None:
        """Check what llama.cpp allocated on each remote (its "RPCn[host:port] model / KV /
        compute buffer size" lines) against the budget: UserError naming the device when over."""
        used: dict[str, dict[str, float]] = {}
        for line in lines:
            m = _BUFFER_LINE.search(line)
            if m:
                index, endpoint, kind, mib = int(m.group(1)), m.group(2), m.group(3), m.group(4)
                device = f"rpc:{endpoint}" + (f"/{index}" if index else "")
                used.setdefault(device, {}).setdefault(kind, 0.0)
                used[device][kind] += float(mib)
        self.allocated = {d: int(sum(k.values()) * 2**20) for d, k in used.items()}
        if self.plan.mode == "llama":
            return                              # llama.cpp's own split: budgets not applied
        for share in self.plan.shares:
            kinds = used.get(share.device, {})
            total = int(sum(kinds.values()) * 2**20)
            if self.plan.mode == "cache":   # the cache's slots are allocated after, by the store
                total += share.bytes
                kinds = {**kinds, "expert slots": share.bytes / 2**20}
            if total > share.capacity:
                parts = ", ".join(f"{k} {v:.1f} MiB" for k, v in kinds.items())
                raise UserError(f"{share.device}: llama.cpp needs {total / 2**20:.1f} MiB there "
                                f"({parts}), above its budget of {share.capacity / 2**20:.1f} "
                                "MiB: raise the budget, or lower -c / -ub (the compute buffer "
                                "grows with both)")

    def check(self) -> None:
        """Raise RemoteDeviceLost once any of this model's links failed (and ever after)."""
        if not self.lost and backend.failure_count() != self._failures_seen:
            self._failures_seen = backend.failure_count()
            self.lost = [h.device for h in self.handles if backend.endpoint_failed(h.endpoint)]
        if self.lost:
            raise RemoteDeviceLost(self.lost)

    def cache_slot_bytes(self) -> dict[str, int]:
        """device -> bytes of expert slots the device cache may hold there (cache mode)."""
        if self.plan.mode != "cache":
            return {}
        return {s.device: s.bytes for s in self.plan.shares}

    def ggml_name(self, device: str) -> str:
        """ggml's name of a remote device of this model ("RPC0", ...); KeyError if none."""
        return next(h.ggml_name for h in self.handles if h.device == device)

    def remote_whole_layers(self) -> set[int]:
        """Layers that run entirely on a remote (layers mode): the routing hook leaves them
        alone, since reading a remote node costs a network round trip per layer per token."""
        if self.plan.mode != "layers":
            return set()
        return {layer for s in self.plan.shares for layer in s.layers}

    def lost_now(self) -> bool:
        """True when a link of this model has failed (check() would raise)."""
        try:
            self.check()
        except RemoteDeviceLost:
            return True
        return False

    def status(self) -> dict[str, str]:
        """device -> "up" | "down"."""
        try:
            self.check()
        except RemoteDeviceLost:
            pass
        return {i.device: ("down" if i.device in self.lost else "up") for i in self.infos}

    def to_dict(self) -> dict:
        d = self.plan.to_dict()
        d["devices"] = [{**i.to_dict(), "ggml_name": h.ggml_name,
                         "allocated_bytes": self.allocated.get(i.device),
                         "status": "down" if i.device in self.lost else "up"}
                        for i, h in zip(self.infos, self.handles)]
        return d

    def to_prometheus(self) -> str:
        lines = ["# HELP moe_rpc_device_up 1 while the remote device's link works, 0 once lost.",
                 "# TYPE moe_rpc_device_up gauge"]
        status = self.status()
        for dev, state in status.items():
            lines.append(f'moe_rpc_device_up{{device="{dev}"}} {int(state == "up")}')
        lines += ["# HELP moe_rpc_planned_bytes Bytes the remote plan put on each device.",
                  "# TYPE moe_rpc_planned_bytes gauge"]
        for s in self.plan.shares:
            lines.append(f'moe_rpc_planned_bytes{{device="{s.device}",mode="{self.plan.mode}"}} '
                         f"{s.bytes}")
        lines += ["# HELP moe_rpc_allocated_bytes Model, KV and compute buffers llama.cpp put "
                  "on each remote device.", "# TYPE moe_rpc_allocated_bytes gauge"]
        for dev, n in self.allocated.items():
            lines.append(f'moe_rpc_allocated_bytes{{device="{dev}"}} {n}')
        lines += ["# HELP moe_rpc_link_rtt_seconds Round trip measured at load.",
                  "# TYPE moe_rpc_link_rtt_seconds gauge"]
        for i in self.infos:
            lines.append(f'moe_rpc_link_rtt_seconds{{device="{i.device}"}} {i.rtt_s:.6g}')
        return "\n".join(lines) + "\n"


def layer_bytes(path: str, facts, n_ctx: int) -> list[LayerBytes]:
    """Per repeating layer: expert-tensor bytes, other tensor bytes, KV bytes (f16 K and V
    at ``n_ctx`` tokens), one expert's bytes. Reads the GGUF's tensor table (read-only)."""
    from gguf_tools.facts import field_value, open_gguf  # noqa: PLC0415

    reader = open_gguf(path)
    experts = [0] * facts.n_layer
    dense = [0] * facts.n_layer
    for t in reader.tensors:
        m = _BLK.match(t.name)
        if m is None:
            continue
        layer = int(m.group(1))
        if layer >= facts.n_layer:
            continue
        if _EXPS.match(t.name):
            experts[layer] += int(t.n_bytes)
        else:
            dense[layer] += int(t.n_bytes)
    arch = facts.arch
    n_head = int(field_value(reader, f"{arch}.attention.head_count", 1) or 1)
    n_head_kv = int(field_value(reader, f"{arch}.attention.head_count_kv", n_head) or n_head)
    k_len = int(field_value(reader, f"{arch}.attention.key_length", facts.n_embd // n_head))
    v_len = int(field_value(reader, f"{arch}.attention.value_length", k_len))
    ctx = n_ctx or facts.context_length
    kv = 2 * ctx * n_head_kv * (k_len + v_len)            # f16: 2 bytes per element
    return [LayerBytes(experts[i], dense[i], kv, facts.expert_bytes[i])
            for i in range(facts.n_layer)]


def compute_reserve(settings, facts, layers: list[LayerBytes]) -> dict[str, int]:
    """Bytes llama.cpp's compute buffer may take on a remote, per plan shape (an upper estimate;
    verify_buffers checks the real figure after the context is made). Layers: the attention
    scores and mask of one ubatch over the whole context (f32) plus activations; experts: the
    expert matmuls' outputs only. Measured on synthetic qwen3moe (embd 256, 4 heads, ub 512):
    7.5 MiB at -c 512, 43.5 MiB at -c 4096; this gives 9.5 and 46.5."""
    from gguf_tools.facts import field_value, open_gguf  # noqa: PLC0415

    reader = open_gguf(settings.model_path)
    n_head = int(field_value(reader, f"{facts.arch}.attention.head_count", 1) or 1)
    ub = min(settings.n_ubatch, settings.n_batch)
    ctx = settings.n_ctx or facts.context_length
    ffn = facts.n_expert_used * max(facts.n_ff_exp, 1)
    act = ub * 4 * (8 * facts.n_embd + 3 * ffn)
    return {"layers": ub * ctx * (4 * n_head + 4) + act + (1 << 20),
            "experts": ub * 4 * (2 * facts.n_embd + 3 * ffn) + (1 << 20)}


def remote_budgets(config) -> tuple:
    return tuple(getattr(config, "remotes", ()) or ()) if config is not None else ()


def resolve_remotes(config, *, largest_expert: int | None = None, timeout: float = PROBE_TIMEOUT_S,
                    bandwidth_bytes: int = PROBE_BANDWIDTH_BYTES):
    """[(budget, RpcDevice, RemoteInfo, capacity bytes)] for each configured remote: probed
    with a short timeout; UserError (one line naming it) when unreachable or over budget."""
    from runtime.residency.capacity import resolve_budget  # noqa: PLC0415

    out = []
    for budget in remote_budgets(config):
        dev = parse_rpc_device(budget.device, f"{config.source}: devices.{budget.device}")
        info = probe(dev, timeout=timeout, bandwidth_bytes=bandwidth_bytes)
        capacity = resolve_budget(budget, free_bytes=info.free_bytes, total_bytes=info.total_bytes,
                                  largest_expert=largest_expert, source=config.source)
        out.append((budget, dev, info, capacity))
    return out


def plan_for(config, facts, settings, resolved) -> RemotePlan:
    """The plan for these resolved remotes (``resolve_remotes``) at the settings' context."""
    layers = layer_bytes(settings.model_path, facts, settings.n_ctx)
    reserve = compute_reserve(settings, facts, layers)
    local_bps = config.cost.cpu_mem_gbps * 1e9
    links = [Link(dev.name, cap, info.rtt_s, info.bandwidth_bps or 1e9, local_bps)
             for _b, dev, info, cap in resolved]
    return plan_remotes(layers, links, mode=getattr(config, "rpc_mode", "auto"),
                        n_expert_used=facts.n_expert_used, n_embd=facts.n_embd,
                        local_bps=local_bps, reserve_bytes=reserve)


def setup_remotes(config, facts, settings, *, log=lambda s: print(s, file=sys.stderr)
                  ) -> RemoteSetup:
    """Probe, plan and register the config's remotes; see the module docstring."""
    from runtime.native import ggml_lib, llama_lib  # noqa: PLC0415

    backend.set_link_timeout(getattr(config, "rpc_timeout_s", None))
    local_gpus = [d.name for d in ggml_lib.devices()           # RPCn: registered remotes
                  if d.kind != ggml_lib.GGML_BACKEND_DEVICE_TYPE_CPU
                  and not d.name.startswith("RPC")]
    if local_gpus and getattr(config, "rpc_mode", "auto") != "llama":
        log(f"moe-offload: note: with rpc devices the plan offloads to the remotes only; "
            f"{', '.join(local_gpus)} here is not used for layers (not supported yet)")
    resolved = resolve_remotes(config, largest_expert=max(facts.expert_bytes) or None)
    plan = plan_for(config, facts, settings, resolved)
    handles = tuple(backend.add_remote(dev.name, dev.endpoint, dev.index)
                    for _b, dev, _i, _c in resolved)
    by_device = {h.device: h for h in handles}
    base = ggml_lib.ggml().base
    rules: list[tuple[str, int]] = []
    n_gpu_layers = None
    used: list[int] = []
    split: list[float] = []
    if plan.mode == "llama":
        n_gpu_layers = 999
        used = list(h.handle for h in handles)
    elif plan.mode == "cache":       # every weight local; the scheduler gets the remote's
        n_gpu_layers = 0             # backend for the cache's hot expert matmuls
        used = list(h.handle for h in handles)
    elif plan.mode == "layers":
        for share in plan.shares:
            if share.layers:
                used.append(by_device[share.device].handle)
                split.append(float(len(share.layers)))
                buft = int(base.ggml_backend_dev_buffer_type(by_device[share.device].handle))
                rules.append((rf"^blk\.({'|'.join(map(str, share.layers))})\.", buft))
        if split:
            split[-1] += 1.0                 # the output "layer" goes with the last range ...
            n_gpu_layers = plan.remote_layers + 1
            rules.append((r"^output", ggml_lib.cpu_buffer_type()))    # ... but stays local
        else:
            n_gpu_layers = 0
    else:                                    # experts: *_exps of the chosen layers remote
        n_gpu_layers = 0
        for share in plan.shares:
            if share.layers:
                used.append(by_device[share.device].handle)
                buft = int(base.ggml_backend_dev_buffer_type(by_device[share.device].handle))
                rules.append((rf"^blk\.({'|'.join(map(str, share.layers))})\."
                              r"ffn_(up|down|gate|gate_up)_(ch|)exps", buft))
    setup = RemoteSetup(plan, tuple(i for _b, _d, i, _c in resolved), handles, n_gpu_layers,
                        tuple(rules))
    if used:
        devices = (ctypes.c_void_p * (len(used) + 1))(*used, None)
        setup.devices = devices
    if split:
        n_max = int(llama_lib.bindings().llama_max_devices())
        arr = (ctypes.c_float * n_max)()
        for i, v in enumerate(split):
            arr[i] = v
        setup.tensor_split = arr
    setup._failures_seen = backend.failure_count()
    log(f"moe-offload: {plan.describe()}")
    return setup
