"""SynthSpec: the shape and contents of a synthetic MoE model, and the names it accepts.

Kept apart from the writer (synth.py, which needs gguf-py) so that the CLI can describe and
parse ``moe-offload synth`` without loading gguf; validation still runs the writer's own
``spec_problem`` (imported when a spec is made).
"""
from __future__ import annotations

from dataclasses import dataclass

ARCHS: tuple[str, ...] = ("qwen3moe", "llama", "gpt-oss", "deepseek2", "olmoe")
DTYPES: tuple[str, ...] = ("f32", "f16", "bf16", "q8_0", "q5_0", "q5_1", "q4_0", "q4_1",
                           "mxfp4", "q4_k", "q6_k", "q4_k_m")
DENSE_LEAD_ARCHS = frozenset({"deepseek2"})      # leading dense layers
SHARED_EXPERT_ARCHS = frozenset({"deepseek2"})   # required there: shared_experts >= 1
MERGED_GATE_UP_ARCHS = frozenset({"deepseek2"})  # ffn_gate_up_exps instead of gate + up
# How tensor types follow from the dtype: "synth" = one dense type and the expert types of the
# dtype (the --dtype table in synth.py); "llama-quantize" = each tensor's type as llama-quantize
# picks it for that file type (src/llama-quant.cpp: quant_rules.py), as in published GGUFs.
TYPE_RULES: tuple[str, ...] = ("synth", "llama-quantize")


class SynthSpecError(ValueError):
    """An impossible synthetic-model shape; ``str()`` is one line for the user."""


@dataclass(frozen=True)
class SynthSpec:
    """Shape and contents of a synthetic MoE model. Validated on construction."""

    arch: str = "qwen3moe"     # one of LAYOUTS
    layers: int = 4
    experts: int = 8
    top_k: int = 2
    embd: int = 64             # n_embd
    ff: int = 32               # expert feed-forward length (n_ff_exp)
    dtype: str = "f32"         # one of DTYPES
    seed: int = 0
    skew: float = 0.0          # Zipf exponent of the per-layer router bias; 0 = even popularity
    heads: int = 4             # n_head
    heads_kv: int = 2          # n_head_kv
    head_dim: int = 0          # 0 = embd // heads
    context_length: int = 4096
    expert_scales: bool = False  # add per-expert ffn_*_exps.scale tensors (f32, ~1.0)
    dense_layers: int = 0      # leading dense (non-MoE) layers (deepseek2)
    shared_experts: int = 0    # always-on shared experts per MoE layer (deepseek2: >= 1)
    gate_up_merged: bool = False  # one ffn_gate_up_exps tensor instead of gate + up (deepseek2)
    name: str = ""             # general.name; "" = "synthetic-<arch>"
    n_vocab: int = 0           # token rows of token_embd/output; 0 = the synthetic vocabulary's
                               # (1,621); more pads the vocabulary with unused "[PADn]" tokens
    type_rules: str = "synth"  # one of TYPE_RULES
    expert_dtype: str = ""     # routed-expert weights' dtype when not dtype's ("mxfp4": gpt-oss)
    kv_lora_rank: int = 0      # deepseek2 compressed KV width; 0 = embd
    rope_dim: int = 0          # deepseek2 rotated dims per head; 0 = head dim // 2
    value_dim: int = 0         # deepseek2 value head dim; 0 = head dim
    dense_ff: int = 0          # deepseek2 dense FFN length (leading dense layers); 0 = 4 * ff

    def __post_init__(self) -> None:
        from gguf_tools.synth import spec_problem  # noqa: PLC0415 - the writer's own checks

        problem = spec_problem(self)
        if problem:
            raise SynthSpecError(problem)

    @property
    def vocab_size(self) -> int:
        from gguf_tools.synth import VOCAB  # noqa: PLC0415

        return self.n_vocab or VOCAB.size

    @property
    def n_head_dim(self) -> int:
        return self.head_dim or self.embd // self.heads
