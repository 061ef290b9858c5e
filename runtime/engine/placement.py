"""Where the expert tensors go at load time: ``tensor_buft_overrides`` rules from the config.

Pure (no llama.cpp): the engine turns each rule's target into a buffer-type pointer.
- residency off: no rules, llama.cpp's own placement (``-ngl`` decides everything);
- residency on: every routed-expert tensor is overridden to the CPU buffer type (the manager
  and its tiers move experts from there), except, with a GPU budget and no device
  cache to manage slots, whole layers' experts that fit the budget are placed on the GPU
  statically (the ``--n-cpu-moe`` idea, sized from bytes instead of a layer count). The
  manager decides which (``ExpertResidencyManager.plan_static``) and pins them, so its
  telemetry for the GPU is the real static residency.
Static rules from llama.cpp's flags (``-ot``, ``--n-cpu-moe``, ``--cpu-moe``:
runtime/engine/llama_flags.py) come first in both cases: llama.cpp's meaning with residency
off; with it on they may keep experts on the CPU (the GPU's static layers then start after
them) and place any other tensor, but routed experts reach a GPU only through its budget.
A rule's target is "cpu", "gpu" (the first GPU) or a ggml buffer type name ("CUDA0").
"""
from __future__ import annotations

from dataclasses import dataclass

from runtime.native.llama_lib import EXPERT_PATTERN
from runtime.residency.static import StaticPlan

_LAYER_EXPERTS = r"^blk\.({layers})\.ffn_(up|down|gate|gate_up)_(ch|)exps"


@dataclass(frozen=True)
class Placement:
    """Override rules, first match wins: (regex over tensor names, "cpu" | "gpu" | a buffer
    type name)."""

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


def cpu_moe_placement(n_cpu_moe: int | None) -> Placement:
    """llama.cpp's ``--n-cpu-moe N``: the routed experts of layers 0..N-1 in host memory,
    everything else where ``-ngl`` puts it (no residency management); None: every layer's
    (``--cpu-moe``). The static baselines the benchmarks compare the managed tiers with."""
    if n_cpu_moe is None:
        return Placement(rules=((EXPERT_PATTERN, "cpu"),))
    if n_cpu_moe <= 0:
        return Placement(rules=())
    layers = "|".join(str(i) for i in range(n_cpu_moe))
    return Placement(rules=((_LAYER_EXPERTS.format(layers=layers), "cpu"),))


def plan_placement(*, manage_residency: bool, static: StaticPlan | None = None,
                   user_rules: tuple[tuple[str, str], ...] = ()) -> Placement:
    """The load-time placement for these settings (see the module docstring). ``static``:
    the manager's plan for the GPU (``ExpertResidencyManager.plan_static``), None when the
    GPU is not a static device (no budget, or the device cache manages it);
    ``user_rules``: llama.cpp's static rules, ahead of everything."""
    if not manage_residency:
        return Placement(rules=tuple(user_rules))
    rules: list[tuple[str, str]] = list(user_rules)
    layers: tuple[int, ...] = static.layers if static is not None else ()
    if layers:
        rules.append((_LAYER_EXPERTS.format(layers="|".join(map(str, layers))), "gpu"))
    rules.append((EXPERT_PATTERN, "cpu"))
    return Placement(rules=tuple(rules), gpu_expert_layers=layers,
                     gpu_expert_bytes=static.bytes if layers else 0)
