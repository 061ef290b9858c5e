"""Where the expert tensors go at load time: ``tensor_buft_overrides`` rules from the config.

Pure (no llama.cpp): the engine turns each rule's target into a buffer-type pointer.
- residency off: no rules, llama.cpp's own placement (``-ngl`` decides everything);
- residency on: every routed-expert tensor is overridden to the CPU buffer type (the manager
  and its tiers move experts from there), except, with a GPU budget and no native device
  cache to manage slots, whole layers' experts that fit the budget are placed on the GPU
  statically (the ``--n-cpu-moe`` idea, sized from bytes instead of a layer count).
"""
from __future__ import annotations

from dataclasses import dataclass

from runtime.engine.llama_lib import EXPERT_PATTERN

_LAYER_EXPERTS = r"^blk\.({layers})\.ffn_(up|down|gate|gate_up)_(ch|)exps"


@dataclass(frozen=True)
class Placement:
    """Override rules, first match wins: (regex over tensor names, "cpu" | "gpu")."""

    rules: tuple[tuple[str, str], ...]
    gpu_expert_layers: tuple[int, ...] = ()   # layers whose experts sit on the GPU statically
    gpu_expert_bytes: int = 0                 # bytes those experts take

    def describe(self) -> str:
        if not self.rules:
            return "llama.cpp placement (residency off)"
        if not self.gpu_expert_layers:
            return "experts on CPU (managed)"
        return (f"experts of {len(self.gpu_expert_layers)} layers on the GPU "
                f"({self.gpu_expert_bytes / 2**20:.1f} MiB), the rest on CPU (managed)")


def static_gpu_layers(expert_bytes: tuple[int, ...], n_expert: int, moe_layers: tuple[int, ...],
                      budget_bytes: int) -> tuple[tuple[int, ...], int]:
    """The first MoE layers whose whole expert sets fit ``budget_bytes`` (bytes), in order,
    and the bytes they take. Layers are kept in order so the GPU part is one contiguous run."""
    chosen, used = [], 0
    for layer in moe_layers:
        size = expert_bytes[layer] * n_expert
        if used + size > budget_bytes:
            break
        chosen.append(layer)
        used += size
    return tuple(chosen), used


def plan_placement(*, manage_residency: bool, expert_bytes: tuple[int, ...], n_expert: int,
                   moe_layers: tuple[int, ...], gpu_budget_bytes: int | None = None,
                   native_cache: bool = False) -> Placement:
    """The load-time placement for these settings (see the module docstring)."""
    if not manage_residency:
        return Placement(rules=())
    rules: list[tuple[str, str]] = []
    layers: tuple[int, ...] = ()
    used = 0
    if gpu_budget_bytes and not native_cache:
        layers, used = static_gpu_layers(expert_bytes, n_expert, moe_layers, gpu_budget_bytes)
        if layers:
            rules.append((_LAYER_EXPERTS.format(layers="|".join(map(str, layers))), "gpu"))
    rules.append((EXPERT_PATTERN, "cpu"))
    return Placement(rules=tuple(rules), gpu_expert_layers=layers, gpu_expert_bytes=used)
