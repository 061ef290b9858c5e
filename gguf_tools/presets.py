"""Presets: the shapes of the published MoE models our users run, by name.

A preset gives every hyper-parameter a synthetic model needs to have the real model's tensors:
the same names, shapes and (through llama-quantize's per-tensor rules, ``quant_rules.py``) types,
so ``moe-offload inspect`` prints the real file's expert bytes per layer and the dense bytes
per layer match too. Only the weights (random) and the tokenizer differ: the vocabulary is the
synthetic one padded with unused ``[PADn]`` tokens to the real row count.

    spec = PRESETS["qwen3-30b-a3b"].spec("q4_k_m", top_k=6)   # a SynthSpec, validated

Sources: each model's config.json as converted by llama.cpp's convert_hf_to_gguf.py (the GGUF
keys), checked against the two real routing traces in tests/runtime/traces/data (Qwen3-30B-A3B
and gpt-oss-120b Q4_K_M: every layer's expert and dense bytes). Kept free of gguf-py so the CLI
lists the names without loading it.
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import TYPE_CHECKING

from gguf_tools.synth_spec import SynthSpecError

if TYPE_CHECKING:
    from gguf_tools.synth_spec import SynthSpec

PRESET_DTYPES: tuple[str, ...] = ("q8_0", "q4_k_m")   # quant_rules.RULE_DTYPES
DEFAULT_DTYPE = "q4_k_m"


@dataclass(frozen=True)
class Preset:
    """One published model's shape; every field but ``name`` and ``model`` is a SynthSpec one."""

    name: str                  # the --preset name
    model: str                 # the published model it reproduces
    arch: str
    layers: int
    experts: int
    top_k: int                 # the model's default experts per token
    embd: int
    ff: int                    # n_ff_exp
    heads: int
    heads_kv: int
    head_dim: int
    context_length: int
    n_vocab: int               # token_embd / output rows
    dense_layers: int = 0
    shared_experts: int = 0
    expert_dtype: str = ""     # experts kept in this type whatever the dtype (gpt-oss: MXFP4)
    kv_lora_rank: int = 0      # deepseek2 attention sizes
    rope_dim: int = 0
    value_dim: int = 0
    dense_ff: int = 0

    def spec(self, dtype: str = DEFAULT_DTYPE, **overrides: object) -> SynthSpec:
        """The SynthSpec of this model at ``dtype``; ``overrides`` replace SynthSpec fields
        (``top_k=6``, ``layers=2``). ``SynthSpecError`` (one line) for an impossible result."""
        from gguf_tools.synth_spec import SynthSpec  # noqa: PLC0415 - validation loads gguf-py

        values = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in _NOT_SPEC}
        values.update(dtype=dtype, type_rules="llama-quantize", name=f"synthetic-{self.name}")
        values.update(overrides)
        return SynthSpec(**values)


_NOT_SPEC = frozenset({"name", "model"})

PRESETS: dict[str, Preset] = {p.name: p for p in (
    Preset("qwen3-30b-a3b", "Qwen3-30B-A3B", "qwen3moe", layers=48, experts=128, top_k=8,
           embd=2048, ff=768, heads=32, heads_kv=4, head_dim=128, context_length=40960,
           n_vocab=151936),
    Preset("qwen3-235b-a22b", "Qwen3-235B-A22B", "qwen3moe", layers=94, experts=128, top_k=8,
           embd=4096, ff=1536, heads=64, heads_kv=4, head_dim=128, context_length=40960,
           n_vocab=151936),
    Preset("gpt-oss-20b", "gpt-oss-20b", "gpt-oss", layers=24, experts=32, top_k=4,
           embd=2880, ff=2880, heads=64, heads_kv=8, head_dim=64, context_length=131072,
           n_vocab=201088, expert_dtype="mxfp4"),
    Preset("gpt-oss-120b", "gpt-oss-120b", "gpt-oss", layers=36, experts=128, top_k=4,
           embd=2880, ff=2880, heads=64, heads_kv=8, head_dim=64, context_length=131072,
           n_vocab=201088, expert_dtype="mxfp4"),
    Preset("mixtral-8x7b", "Mixtral-8x7B", "llama", layers=32, experts=8, top_k=2,
           embd=4096, ff=14336, heads=32, heads_kv=8, head_dim=128, context_length=32768,
           n_vocab=32000),
    # 16 heads of query/key dim 192 (128 + 64 rotated) and value dim 128; KV through a
    # 512-wide compressed projection (attn_kv_a_mqa, attn_kv_b, as in the common GGUFs)
    Preset("deepseek-v2-lite", "DeepSeek-V2-Lite", "deepseek2", layers=27, experts=64, top_k=6,
           embd=2048, ff=1408, heads=16, heads_kv=16, head_dim=192, context_length=163840,
           n_vocab=102400, dense_layers=1, shared_experts=2, kv_lora_rank=512, rope_dim=64,
           value_dim=128, dense_ff=10944),
    Preset("olmoe-1b-7b", "OLMoE-1B-7B", "olmoe", layers=16, experts=64, top_k=8,
           embd=2048, ff=1024, heads=16, heads_kv=16, head_dim=128, context_length=4096,
           n_vocab=50304),
)}


def get_preset(name: str) -> Preset:
    """The preset called ``name``; ``SynthSpecError`` listing the valid names otherwise."""
    try:
        return PRESETS[name]
    except KeyError:
        raise SynthSpecError(f"unknown preset {name!r} (choose from {', '.join(PRESETS)})") \
            from None
