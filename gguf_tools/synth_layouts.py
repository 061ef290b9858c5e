"""Per-architecture tensor layouts and hyper-parameter keys for synthetic MoE models.

Each layout lists the tensors llama.cpp (as vendored by llama-cpp-python 0.3.36) requires for
that architecture (see ``src/models/<arch>.cpp``, ``load_arch_tensors``), with shapes in ggml
order (ne0 first, ne0 contiguous) and how to initialise them.

Numerics (why the init looks like this): channel 0 of the residual stream is a constant 1.0 —
the token embedding sets it, and every projection that writes into the residual stream has its
row 0 zeroed — so the router's column 0 acts as a per-expert bias. ``skew`` puts a Zipf-like
bias there (``-skew * log(rank + 1)``, rank drawn per layer), which makes expert popularity
uneven and different per layer while the random remaining columns still pick different experts
for different tokens.

``tensor_plans(spec)`` is a spec's whole tensor list, with the ggml types its dtype picks (the
--dtype table ``SIMPLE_DTYPES``, or llama-quantize's per-tensor rules). This module does not
import synth_spec (the spec is only a type here): SynthSpec's validation imports it for
``block_problem``.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Callable

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as Q

from gguf_tools import synth_vocab
from gguf_tools.quant_rules import llama_quantize_type, more_bits

if TYPE_CHECKING:  # pragma: no cover
    from gguf_tools.synth_spec import SynthSpec

# init kinds
NORMAL = "normal"      # N(0, std), optionally with row 0 (output channel 0) zeroed
ONES = "ones"
ZEROS = "zeros"
EMBED = "embed"        # N(0, 1), column 0 = 1.0 (the bias channel)
ROUTER = "router"      # N(0, std) with column 0 = skew bias of this layer
UNIFORM = "uniform"    # U(low, high) (per-expert scales)


@dataclass(frozen=True)
class TensorPlan:
    """One tensor of a synthetic model."""

    name: str
    shape: tuple[int, ...]   # ggml order: (ne0, ne1, ne2); numpy order is reversed
    qtype: Q
    init: str
    std: float = 0.0
    layer: int = -1          # router: which layer's popularity ranking
    zero_row0: bool = False  # rows of numpy shape (..., n_out, ne0): output channel 0 -> 0
    low: float = 0.0
    high: float = 0.0
    live_rows: int = 0       # token_embd/output of a padded vocabulary: rows past this are the
                             # unused [PADn] tokens' (embeddings random, output rows zero)


@dataclass(frozen=True)
class ArchLayout:
    """How to write one architecture: its GGUF name, hparam keys and per-layer tensors."""

    name: str                      # general.architecture
    real_model: str                # the real family this mimics (for docs and inspect)
    tensors: Callable[[SynthSpec, "Types"], list[TensorPlan]]
    uses_expert_ff_key: bool       # writes {arch}.expert_feed_forward_length
    extra_kv: Callable[[SynthSpec], dict[str, int | float]]


@dataclass(frozen=True)
class Types:
    """The ggml types chosen for one model: dense 2D weights, and experts per layer."""

    dense: Q
    gate_up: tuple[Q, ...]         # per layer
    down: tuple[Q, ...]            # per layer


def _common_top(spec: SynthSpec, t: Types) -> list[TensorPlan]:
    vocab = spec.vocab_size
    live = synth_vocab.build_vocab().size
    live = live if vocab > live else 0
    plans = [
        TensorPlan("token_embd.weight", (spec.embd, vocab), t.dense, EMBED, live_rows=live),
        TensorPlan("output_norm.weight", (spec.embd,), Q.F32, ONES),
    ]
    # A separate output head (gpt-oss and olmoe require one; the others accept one).
    plans.append(TensorPlan("output.weight", (spec.embd, vocab), t.dense, NORMAL,
                            std=2.0 / spec.embd ** 0.5, live_rows=live))
    return plans


def _attention(spec: SynthSpec, t: Types, i: int, *, qk_norm: int = 0, biases: bool = False,
               kv_heads: int = 0) -> list[TensorPlan]:
    hd = spec.n_head_dim
    q_dim, kv_dim = spec.heads * hd, (kv_heads or spec.heads_kv) * hd
    p = f"blk.{i}."
    plans = [
        TensorPlan(p + "attn_norm.weight", (spec.embd,), Q.F32, ONES),
        TensorPlan(p + "attn_q.weight", (spec.embd, q_dim), t.dense, NORMAL, std=spec.embd ** -0.5),
        TensorPlan(p + "attn_k.weight", (spec.embd, kv_dim), t.dense, NORMAL, std=spec.embd ** -0.5),
        TensorPlan(p + "attn_v.weight", (spec.embd, kv_dim), t.dense, NORMAL, std=spec.embd ** -0.5),
        TensorPlan(p + "attn_output.weight", (q_dim, spec.embd), t.dense, NORMAL,
                   std=0.5 * q_dim ** -0.5, zero_row0=True),
    ]
    if biases:   # q, k, v, output (gpt-oss)
        plans += [TensorPlan(p + "attn_q.bias", (q_dim,), Q.F32, ZEROS),
                  TensorPlan(p + "attn_k.bias", (kv_dim,), Q.F32, ZEROS),
                  TensorPlan(p + "attn_v.bias", (kv_dim,), Q.F32, ZEROS),
                  TensorPlan(p + "attn_output.bias", (spec.embd,), Q.F32, ZEROS)]
    if qk_norm:
        plans.append(TensorPlan(p + "attn_q_norm.weight", (qk_norm,), Q.F32, ONES))
        plans.append(TensorPlan(p + "attn_k_norm.weight", (qk_norm,), Q.F32, ONES))
    return plans


def _experts(spec: SynthSpec, t: Types, i: int, *, biases: bool = False) -> list[TensorPlan]:
    e, d, f = spec.experts, spec.embd, spec.ff
    p = f"blk.{i}."
    plans = [TensorPlan(p + "ffn_gate_inp.weight", (d, e), Q.F32, ROUTER, std=d ** -0.5, layer=i)]
    if spec.gate_up_merged:   # one tensor, gate rows then up rows per expert
        plans.append(TensorPlan(p + "ffn_gate_up_exps.weight", (d, 2 * f, e), t.gate_up[i],
                                NORMAL, std=d ** -0.5))
    else:
        plans += [
            TensorPlan(p + "ffn_gate_exps.weight", (d, f, e), t.gate_up[i], NORMAL, std=d ** -0.5),
            TensorPlan(p + "ffn_up_exps.weight", (d, f, e), t.gate_up[i], NORMAL, std=d ** -0.5),
        ]
    plans.append(TensorPlan(p + "ffn_down_exps.weight", (f, d, e), t.down[i], NORMAL,
                            std=0.5 * f ** -0.5, zero_row0=True))
    if biases:
        plans += [
            TensorPlan(p + "ffn_gate_inp.bias", (e,), Q.F32, ZEROS),
            TensorPlan(p + "ffn_gate_exps.bias", (f, e), Q.F32, NORMAL, std=0.02),
            TensorPlan(p + "ffn_up_exps.bias", (f, e), Q.F32, NORMAL, std=0.02),
            TensorPlan(p + "ffn_down_exps.bias", (d, e), Q.F32, NORMAL, std=0.02, zero_row0=True),
        ]
    if spec.expert_scales:  # optional per-expert ".scale" tensors llama.cpp loads for any arch
        for proj in ("gate", "up", "down"):
            plans.append(TensorPlan(p + f"ffn_{proj}_exps.scale", (e,), Q.F32, UNIFORM,
                                    low=0.75, high=1.25))
    return plans


def _qwen3moe(spec: SynthSpec, t: Types) -> list[TensorPlan]:
    plans = _common_top(spec, t)
    for i in range(spec.layers):
        plans += _attention(spec, t, i, qk_norm=spec.n_head_dim)
        plans.append(TensorPlan(f"blk.{i}.ffn_norm.weight", (spec.embd,), Q.F32, ONES))
        plans += _experts(spec, t, i)
    return plans


def _llama(spec: SynthSpec, t: Types) -> list[TensorPlan]:
    plans = _common_top(spec, t)
    for i in range(spec.layers):
        plans += _attention(spec, t, i)
        plans.append(TensorPlan(f"blk.{i}.ffn_norm.weight", (spec.embd,), Q.F32, ONES))
        plans += _experts(spec, t, i)
    return plans


def _olmoe(spec: SynthSpec, t: Types) -> list[TensorPlan]:
    # q/k norms span all heads ({n_embd}), so K has as many heads as Q (see _olmoe_kv)
    plans = _common_top(spec, t)
    for i in range(spec.layers):
        plans += _attention(spec, t, i, qk_norm=spec.embd, kv_heads=spec.heads)
        plans.append(TensorPlan(f"blk.{i}.ffn_norm.weight", (spec.embd,), Q.F32, ONES))
        plans += _experts(spec, t, i)
    return plans


def _olmoe_kv(spec: SynthSpec) -> dict[str, int | float]:
    return {"attention.head_count_kv": spec.heads}


def _gpt_oss(spec: SynthSpec, t: Types) -> list[TensorPlan]:
    plans = _common_top(spec, t)
    for i in range(spec.layers):
        plans += _attention(spec, t, i, biases=True)
        plans.append(TensorPlan(f"blk.{i}.post_attention_norm.weight", (spec.embd,), Q.F32, ONES))
        plans.append(TensorPlan(f"blk.{i}.attn_sinks.weight", (spec.heads,), Q.F32, ZEROS))
        plans += _experts(spec, t, i, biases=True)
    return plans


def _dense_ffn(spec: SynthSpec, t: Types, i: int, ff: int, suffix: str = "") -> list[TensorPlan]:
    p, d = f"blk.{i}.", spec.embd
    return [
        TensorPlan(p + f"ffn_gate{suffix}.weight", (d, ff), t.dense, NORMAL, std=d ** -0.5),
        TensorPlan(p + f"ffn_up{suffix}.weight", (d, ff), t.dense, NORMAL, std=d ** -0.5),
        TensorPlan(p + f"ffn_down{suffix}.weight", (ff, d), t.dense, NORMAL,
                   std=0.5 * ff ** -0.5, zero_row0=True),
    ]


def _deepseek2(spec: SynthSpec, t: Types) -> list[TensorPlan]:
    dims = spec.deepseek2_dims
    h, d, kv = spec.heads, spec.embd, dims["kv_lora"]
    plans = _common_top(spec, t)
    for i in range(spec.layers):
        p = f"blk.{i}."
        plans += [
            TensorPlan(p + "attn_norm.weight", (d,), Q.F32, ONES),
            TensorPlan(p + "attn_kv_a_norm.weight", (kv,), Q.F32, ONES),
            TensorPlan(p + "attn_q.weight", (d, h * (dims["nope"] + dims["rope"])), t.dense,
                       NORMAL, std=d ** -0.5),
            TensorPlan(p + "attn_kv_a_mqa.weight", (d, kv + dims["rope"]), t.dense, NORMAL,
                       std=d ** -0.5),
            TensorPlan(p + "attn_kv_b.weight", (kv, h * (dims["nope"] + dims["v"])), t.dense,
                       NORMAL, std=kv ** -0.5),
            TensorPlan(p + "attn_output.weight", (h * dims["v"], d), t.dense, NORMAL,
                       std=0.5 * (h * dims["v"]) ** -0.5, zero_row0=True),
            TensorPlan(p + "ffn_norm.weight", (d,), Q.F32, ONES),
        ]
        if i < spec.dense_layers:
            plans += _dense_ffn(spec, t, i, dims["dense_ff"])
        else:
            plans += _experts(spec, t, i)
            plans += _dense_ffn(spec, t, i, spec.ff * spec.shared_experts, "_shexp")
    return plans


def _deepseek2_kv(spec: SynthSpec) -> dict[str, int | float]:
    dims = spec.deepseek2_dims
    return {"leading_dense_block_count": spec.dense_layers,
            "expert_shared_count": spec.shared_experts,
            "attention.q_lora_rank": 0, "attention.kv_lora_rank": dims["kv_lora"],
            "attention.key_length": dims["nope"] + dims["rope"],
            "attention.value_length": dims["v"], "rope.dimension_count": dims["rope"],
            "expert_weights_scale": 1.0, "expert_gating_func": 1,  # softmax
            "attention.head_count_kv": spec.heads,   # the non-MLA path has one KV head per head
            "feed_forward_length": dims["dense_ff"]}


def _no_kv(spec: SynthSpec) -> dict[str, int | float]:
    return {}


def _gpt_oss_kv(spec: SynthSpec) -> dict[str, int | float]:
    return {"attention.sliding_window": 128}


LAYOUTS: dict[str, ArchLayout] = {
    "qwen3moe": ArchLayout("qwen3moe", "Qwen3-30B-A3B / Qwen3-235B-A22B", _qwen3moe, True, _no_kv),
    "llama": ArchLayout("llama", "Mixtral-8x7B (llama with experts)", _llama, False, _no_kv),
    "gpt-oss": ArchLayout("gpt-oss", "gpt-oss-20b / gpt-oss-120b", _gpt_oss, True, _gpt_oss_kv),
    "deepseek2": ArchLayout("deepseek2", "DeepSeek-V2-Lite", _deepseek2, True, _deepseek2_kv),
    "olmoe": ArchLayout("olmoe", "OLMoE-1B-7B", _olmoe, False, _olmoe_kv),
}


# --dtype name -> (expert type, dense 2D type). "q4_k_m" is resolved per layer (see _types).
SIMPLE_DTYPES: dict[str, tuple[Q, Q]] = {
    "f32": (Q.F32, Q.F32),
    "f16": (Q.F16, Q.F16),
    "bf16": (Q.BF16, Q.BF16),
    "q8_0": (Q.Q8_0, Q.Q8_0),
    "q5_0": (Q.Q5_0, Q.Q5_0),
    "q5_1": (Q.Q5_1, Q.Q5_1),
    "q4_0": (Q.Q4_0, Q.Q4_0),
    "q4_1": (Q.Q4_1, Q.Q4_1),
    "mxfp4": (Q.MXFP4, Q.Q8_0),   # gpt-oss style: MXFP4 experts, 8-bit everything else
}


def _dtype_types(dtype: str, n: int) -> Types:
    if dtype in SIMPLE_DTYPES:
        expert, dense = SIMPLE_DTYPES[dtype]
        return Types(dense=dense, gate_up=(expert,) * n, down=(expert,) * n)
    if dtype == "q4_k":
        return Types(dense=Q.Q8_0, gate_up=(Q.Q4_K,) * n, down=(Q.Q4_K,) * n)
    if dtype == "q6_k":
        return Types(dense=Q.Q8_0, gate_up=(Q.Q6_K,) * n, down=(Q.Q6_K,) * n)
    # q4_k_m: Q4_K gate/up, Q6_K down on the "more bits" layers, as llama-quantize does
    down = tuple(Q.Q6_K if more_bits(i, n) else Q.Q4_K for i in range(n))
    return Types(dense=Q.Q8_0, gate_up=(Q.Q4_K,) * n, down=down)


def _types(spec: SynthSpec) -> Types:
    types = _dtype_types(spec.dtype, spec.layers)
    if spec.expert_dtype:
        experts = _dtype_types(spec.expert_dtype, spec.layers)
        types = Types(dense=types.dense, gate_up=experts.gate_up, down=experts.down)
    return types


def tensor_plans(spec: SynthSpec) -> list[TensorPlan]:
    """Every tensor the model will contain, in file order."""
    plans = LAYOUTS[spec.arch].tensors(spec, _types(spec))
    if spec.type_rules == "llama-quantize":
        plans = [_llama_quantize(spec, plan) for plan in plans]
    return plans


def _llama_quantize(spec: SynthSpec, plan: TensorPlan) -> TensorPlan:
    if spec.expert_dtype and "_exps.weight" in plan.name:
        return plan   # routed experts kept in their own type (gpt-oss ships them in MXFP4)
    qtype = llama_quantize_type(plan.name, plan.shape, spec.dtype, n_layer=spec.layers,
                                n_expert=spec.experts)
    return plan if qtype is None else replace(plan, qtype=qtype)


def block_problem(spec: SynthSpec) -> str | None:
    """Why ``spec``'s planned tensors do not fit their types' blocks (one line), or None.

    The last of ``synth_spec.spec_problem``'s checks (the one that needs gguf-py): it plans
    the tensors of a spec whose shape has passed the others."""
    for plan in tensor_plans(spec):
        block = GGML_QUANT_SIZES[plan.qtype][0]
        if plan.shape[0] % block:
            return (f"--dtype {spec.dtype}: {plan.qtype.name} packs rows in blocks of {block}, "
                    f"but {plan.name} has rows of {plan.shape[0]} (--embd/--ff/--head-dim must be "
                    f"multiples of {block})")
    return None
