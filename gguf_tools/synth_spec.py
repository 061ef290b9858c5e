"""SynthSpec: the shape and contents of a synthetic MoE model, and the names it accepts.

Kept apart from the writer (synth.py, which needs gguf-py) so that the CLI can describe and
parse ``moe-offload synth`` without loading gguf. ``spec_problem`` checks the shape here; the
checks that need gguf-py's types (llama-quantize's file types, ggml block sizes over the planned
tensors) are imported when a spec is made, from modules that do not import this one back.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from gguf_tools import synth_vocab

ARCHS: tuple[str, ...] = ("qwen3moe", "llama", "gpt-oss", "deepseek2", "olmoe")
DTYPES: tuple[str, ...] = ("f32", "f16", "bf16", "q8_0", "q5_0", "q5_1", "q4_0", "q4_1",
                           "mxfp4", "q4_k", "q6_k", "q4_k_m")
DENSE_LEAD_ARCHS = frozenset({"deepseek2"})      # leading dense layers
SHARED_EXPERT_ARCHS = frozenset({"deepseek2"})   # required there: shared_experts >= 1
MERGED_GATE_UP_ARCHS = frozenset({"deepseek2"})  # ffn_gate_up_exps instead of gate + up
# How tensor types follow from the dtype: "synth" = one dense type and the expert types of the
# dtype (the --dtype table in synth_layouts.py); "llama-quantize" = each tensor's type as
# llama-quantize picks it for that file type (src/llama-quant.cpp: quant_rules.py), as in
# published GGUFs.
TYPE_RULES: tuple[str, ...] = ("synth", "llama-quantize")
_MAX_EXPERTS = 1024  # LLAMA_MAX_EXPERTS in llama-hparams.h


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
        problem = spec_problem(self)
        if problem:
            raise SynthSpecError(problem)

    @property
    def vocab_size(self) -> int:
        return self.n_vocab or synth_vocab.build_vocab().size

    @property
    def n_head_dim(self) -> int:
        return self.head_dim or self.embd // self.heads

    @property
    def deepseek2_dims(self) -> dict[str, int]:
        """Attention sizes of the synthetic deepseek2 (plain, non-MLA-split KV projection).

        The head dimension is the query/key one (nope + rope: DeepSeek-V2-Lite 128 + 64 = 192)."""
        hd = self.n_head_dim
        rope = self.rope_dim or hd // 2
        return {"rope": rope, "nope": hd - rope, "v": self.value_dim or hd,
                "kv_lora": self.kv_lora_rank or self.embd, "dense_ff": self.dense_ff or 4 * self.ff}


def spec_problem(spec: SynthSpec) -> str | None:
    """The first reason ``spec`` cannot be written (one line), or None."""
    if spec.arch not in ARCHS:
        return f"unknown arch {spec.arch!r} (choose from {', '.join(ARCHS)})"
    if spec.dtype not in DTYPES:
        return f"unknown dtype {spec.dtype!r} (choose from {', '.join(DTYPES)})"
    if spec.expert_dtype and spec.expert_dtype not in DTYPES:
        return f"unknown expert dtype {spec.expert_dtype!r} (choose from {', '.join(DTYPES)})"
    if spec.type_rules not in TYPE_RULES:
        return f"unknown type rules {spec.type_rules!r} (choose from {', '.join(TYPE_RULES)})"
    if spec.type_rules == "llama-quantize":
        from gguf_tools.quant_rules import RULE_DTYPES  # noqa: PLC0415 - loads gguf-py

        if spec.dtype not in RULE_DTYPES:
            return (f"--dtype {spec.dtype}: llama-quantize's per-tensor types are transcribed for "
                    f"{', '.join(RULE_DTYPES)} only")
    for label, value, low in (("layers", spec.layers, 1), ("experts", spec.experts, 1),
                              ("top-k", spec.top_k, 1), ("embd", spec.embd, 2), ("ff", spec.ff, 1),
                              ("heads", spec.heads, 1), ("heads-kv", spec.heads_kv, 1),
                              ("context-length", spec.context_length, 1)):
        if value < low:
            return f"--{label} must be at least {low}, got {value}"
    if spec.head_dim < 0 or spec.seed < 0:
        return "--head-dim and --seed must not be negative"
    mla = {"kv_lora_rank": spec.kv_lora_rank, "rope_dim": spec.rope_dim,
           "value_dim": spec.value_dim, "dense_ff": spec.dense_ff}
    if spec.n_vocab < 0 or min(mla.values()) < 0:
        return "--n-vocab and the deepseek2 sizes must not be negative"
    vocab = synth_vocab.build_vocab()
    if spec.n_vocab and spec.n_vocab < vocab.size:
        return (f"--n-vocab {spec.n_vocab} is less than the synthetic vocabulary's "
                f"{vocab.size} tokens")
    if any(mla.values()) and spec.arch != "deepseek2":
        return f"{', '.join(k for k, v in mla.items() if v)}: only --arch deepseek2 has them"
    if spec.top_k > spec.experts:
        return f"--top-k {spec.top_k} is more than --experts {spec.experts}"
    if spec.experts > _MAX_EXPERTS:
        return f"--experts {spec.experts} is more than llama.cpp's maximum of {_MAX_EXPERTS}"
    if spec.layers > 512:
        return f"--layers {spec.layers} is more than llama.cpp's maximum of 512"
    if spec.heads % spec.heads_kv:
        return f"--heads {spec.heads} is not a multiple of --heads-kv {spec.heads_kv}"
    if not spec.head_dim and spec.embd % spec.heads:
        return f"--embd {spec.embd} is not a multiple of --heads {spec.heads} (or give --head-dim)"
    if spec.arch == "olmoe" and spec.n_head_dim * spec.heads != spec.embd:
        return "--arch olmoe needs --heads x head dimension == --embd (leave --head-dim 0)"
    if spec.n_head_dim % 2:
        return f"head dimension {spec.n_head_dim} must be even (RoPE rotates pairs)"
    if spec.arch == "deepseek2":
        rope = spec.deepseek2_dims["rope"]
        if rope % 2 or not 0 < rope < spec.n_head_dim:
            return (f"deepseek2 rope_dim {rope} must be even and less than the head dimension "
                    f"{spec.n_head_dim}")
    if spec.dense_layers and spec.arch not in DENSE_LEAD_ARCHS:
        return f"--arch {spec.arch} has no leading dense layers (--dense-layers needs deepseek2)"
    if not 0 <= spec.dense_layers < spec.layers:
        return f"--dense-layers must be in 0..{spec.layers - 1} (at least one MoE layer)"
    if spec.arch in SHARED_EXPERT_ARCHS and spec.shared_experts < 1:
        return f"--arch {spec.arch} needs --shared-experts of at least 1"
    if spec.shared_experts and spec.arch not in SHARED_EXPERT_ARCHS:
        return f"--arch {spec.arch} has no shared experts (--shared-experts needs deepseek2)"
    if spec.gate_up_merged and spec.arch not in MERGED_GATE_UP_ARCHS:
        return f"--arch {spec.arch} cannot load a merged ffn_gate_up_exps (needs deepseek2)"
    if spec.gate_up_merged and spec.expert_scales:
        return "--expert-scales needs separate gate and up tensors (llama.cpp loads no " \
               "ffn_gate_up_exps.scale)"
    if not math.isfinite(spec.skew) or spec.skew < 0:
        return f"--skew must be a finite number >= 0, got {spec.skew}"
    from gguf_tools.synth_layouts import block_problem  # noqa: PLC0415 - loads gguf-py

    return block_problem(spec)
