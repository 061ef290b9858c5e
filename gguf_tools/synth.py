"""Write random-weight MoE GGUF models that llama.cpp loads and runs like real ones.

The writer streams: tensor infos first, then each tensor's data one slab at a time (one expert of
a 3D expert tensor, or a whole 1D/2D tensor), so RAM stays bounded by the largest slab even for
full-size shapes (Qwen3-30B-A3B: 48 layers x 128 experts of 2048 x 768). Every slab's values come
from an RNG seeded by (seed, tensor name, slab index): the same spec gives the same bytes.

Usage::

    spec = SynthSpec(arch="qwen3moe", layers=4, experts=8, top_k=2, dtype="q8_0", skew=1.0)
    write_synthetic_model("tiny.gguf", spec)
"""
from __future__ import annotations

import math
import os
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as Q, GGUFWriter
from gguf.constants import GGML_QUANT_VERSION
from gguf.quants import quantize

from gguf_tools import synth_vocab
from runtime.atomic_write import AtomicTarget, write_error
from gguf_tools.synth_spec import DTYPES, SynthSpec, SynthSpecError  # noqa: F401 - re-exported
from gguf_tools.synth_layouts import (DENSE_LEAD_ARCHS, EMBED, LAYOUTS, MERGED_GATE_UP_ARCHS,
                                      NORMAL, ONES, ROUTER, SHARED_EXPERT_ARCHS, UNIFORM, ZEROS,
                                      TensorPlan, Types)
from gguf_tools.synth_blocks import BLOCK_TYPES, random_blocks

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
assert DTYPES == (*SIMPLE_DTYPES, "q4_k", "q6_k", "q4_k_m"), "synth_spec.DTYPES is stale"
VOCAB = synth_vocab.build_vocab()
_MAX_EXPERTS = 1024  # LLAMA_MAX_EXPERTS in llama-hparams.h


def spec_problem(spec: SynthSpec) -> str | None:
    """The first reason ``spec`` cannot be written (one line), or None."""
    if spec.arch not in LAYOUTS:
        return f"unknown arch {spec.arch!r} (choose from {', '.join(LAYOUTS)})"
    if spec.dtype not in DTYPES:
        return f"unknown dtype {spec.dtype!r} (choose from {', '.join(DTYPES)})"
    for label, value, low in (("layers", spec.layers, 1), ("experts", spec.experts, 1),
                              ("top-k", spec.top_k, 1), ("embd", spec.embd, 2), ("ff", spec.ff, 1),
                              ("heads", spec.heads, 1), ("heads-kv", spec.heads_kv, 1),
                              ("context-length", spec.context_length, 1)):
        if value < low:
            return f"--{label} must be at least {low}, got {value}"
    if spec.head_dim < 0 or spec.seed < 0:
        return "--head-dim and --seed must not be negative"
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
    types = _types(spec)
    for plan in LAYOUTS[spec.arch].tensors(spec, types):
        block = GGML_QUANT_SIZES[plan.qtype][0]
        if plan.shape[0] % block:
            return (f"--dtype {spec.dtype}: {plan.qtype.name} packs rows in blocks of {block}, "
                    f"but {plan.name} has rows of {plan.shape[0]} (--embd/--ff/--head-dim must be "
                    f"multiples of {block})")
    return None


def _more_bits(layer: int, n_layer: int) -> bool:
    # llama.cpp's use_more_bits() for Q4_K_M: first and last eighth, and every third layer.
    return layer < n_layer // 8 or layer >= 7 * n_layer // 8 or (layer - n_layer // 8) % 3 == 2


def _types(spec: SynthSpec) -> Types:
    n = spec.layers
    if spec.dtype in SIMPLE_DTYPES:
        expert, dense = SIMPLE_DTYPES[spec.dtype]
        return Types(dense=dense, gate_up=(expert,) * n, down=(expert,) * n)
    if spec.dtype == "q4_k":
        return Types(dense=Q.Q8_0, gate_up=(Q.Q4_K,) * n, down=(Q.Q4_K,) * n)
    if spec.dtype == "q6_k":
        return Types(dense=Q.Q8_0, gate_up=(Q.Q6_K,) * n, down=(Q.Q6_K,) * n)
    # q4_k_m: Q4_K gate/up, Q6_K down on the "more bits" layers, as llama-quantize does
    down = tuple(Q.Q6_K if _more_bits(i, n) else Q.Q4_K for i in range(n))
    return Types(dense=Q.Q8_0, gate_up=(Q.Q4_K,) * n, down=down)


def tensor_plans(spec: SynthSpec) -> list[TensorPlan]:
    """Every tensor the model will contain, in file order."""
    return LAYOUTS[spec.arch].tensors(spec, _types(spec))


def tensor_nbytes(plan: TensorPlan) -> int:
    """Bytes of one tensor's data (without alignment padding)."""
    block, type_size = GGML_QUANT_SIZES[plan.qtype]
    rows = math.prod(plan.shape[1:])
    return rows * (plan.shape[0] // block) * type_size


def planned_data_bytes(spec: SynthSpec, alignment: int = 32) -> int:
    """Bytes of the data section, padding included (for progress bars)."""
    return sum(-(-tensor_nbytes(p) // alignment) * alignment for p in tensor_plans(spec))


def _rng(spec: SynthSpec, name: str, slab: int) -> np.random.Generator:
    return np.random.default_rng([spec.seed, zlib.crc32(name.encode()), slab])


def _router_bias(spec: SynthSpec, layer: int) -> np.ndarray:
    # (n_expert,) float32: -skew * log(rank + 1), ranks permuted per layer
    ranks = _rng(spec, f"router-rank.{layer}", 0).permutation(spec.experts)
    return (-spec.skew * np.log1p(ranks)).astype(np.float32)


def _slab_values(spec: SynthSpec, plan: TensorPlan, slab: int, shape: tuple[int, ...]) -> np.ndarray:
    """float32 values of one slab, numpy order ``shape``."""
    if plan.init == ONES:
        return np.ones(shape, np.float32)
    if plan.init == ZEROS:
        return np.zeros(shape, np.float32)
    rng = _rng(spec, plan.name, slab)
    if plan.init == UNIFORM:
        return rng.uniform(plan.low, plan.high, shape).astype(np.float32)
    x = rng.standard_normal(shape, dtype=np.float32)
    if plan.init == EMBED:  # (n_vocab, n_embd); channel 0 is the constant bias channel
        x[:, 0] = 1.0
    elif plan.init == ROUTER:  # (n_expert, n_embd)
        x *= plan.std
        x[:, 0] = _router_bias(spec, plan.layer)
    elif plan.init == NORMAL:
        x *= plan.std
        if plan.zero_row0:  # output channel 0 stays untouched in the residual stream
            if plan.name.endswith(".bias"):
                x[..., 0] = 0.0
            else:
                x[..., 0, :] = 0.0
    else:  # pragma: no cover - layouts only use the kinds above
        raise AssertionError(plan.init)
    return x


def _slab_bytes(spec: SynthSpec, plan: TensorPlan) -> Iterator[np.ndarray]:
    """The tensor's data as uint8/float arrays, one slab (expert) at a time."""
    np_shape = tuple(reversed(plan.shape))
    slabs, slab_shape = (np_shape[0], np_shape[1:]) if len(np_shape) == 3 else (1, np_shape)
    for s in range(slabs):
        if plan.qtype in BLOCK_TYPES and plan.init == NORMAL:
            # random quants written directly: fast, and the only way for K-quants
            rows = math.prod(slab_shape[:-1])
            yield random_blocks(_rng(spec, plan.name, s), plan.qtype, rows, slab_shape[-1],
                                std=plan.std, zero_row0=plan.zero_row0)
            continue
        values = _slab_values(spec, plan, s, slab_shape)
        if plan.qtype == Q.F32:
            yield values
        elif plan.qtype == Q.F16:
            yield values.astype(np.float16)
        else:
            yield quantize(values, plan.qtype)


def write_synthetic_model(path: str | os.PathLike[str], spec: SynthSpec, *,
                          progress: Callable[[int], None] | None = None) -> Path:
    """Write ``spec`` as a GGUF file at ``path`` and return the path.

    Writes to a temporary file in the same directory and renames it into place
    (runtime.atomic_write), so an interrupted write never leaves a partial ``path`` and the
    next write removes a killed one's temp file. ``progress(n)`` is called with the number
    of data bytes written since the last call (summing to ``planned_data_bytes(spec)``).
    """
    out = Path(path)
    target = AtomicTarget(out)
    layout = LAYOUTS[spec.arch]
    plans = tensor_plans(spec)
    writer = GGUFWriter(None, layout.name)
    try:
        _add_metadata(writer, spec)
        for plan in plans:
            writer.add_tensor_info(plan.name, tuple(reversed(plan.shape)), np.dtype(np.float32),
                                   tensor_nbytes(plan), raw_dtype=plan.qtype)
        writer.write_header_to_file(target.tmp)
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        fout = writer.fout[0]
        writer.write_padding(fout, fout.tell())
        for plan in plans:
            written = 0
            for chunk in _slab_bytes(spec, plan):
                buf = memoryview(np.ascontiguousarray(chunk)).cast("B")
                fout.write(buf)
                written += len(buf)
                if progress:
                    progress(len(buf))
            assert written == tensor_nbytes(plan), (plan.name, written)
            writer.write_padding(fout, written)
            if progress:   # count the alignment padding too: the total is planned_data_bytes
                progress(-(-written // writer.data_alignment) * writer.data_alignment - written)
        writer.close()
    except OSError as err:
        writer.close()
        target.discard()
        raise write_error(out, err) from None
    except BaseException:
        writer.close()
        target.discard()
        raise
    target.publish()
    return out


def _add_metadata(w: GGUFWriter, spec: SynthSpec) -> None:
    layout = LAYOUTS[spec.arch]
    extra = layout.extra_kv(spec)
    w.add_name(spec.name or f"synthetic-{spec.arch}")
    w.add_description(f"random-weight {layout.real_model} shaped MoE model written by moe-offload "
                      f"synth (seed {spec.seed}, skew {spec.skew}, dtype {spec.dtype})")
    w.add_quantization_version(GGML_QUANT_VERSION)
    w.add_context_length(spec.context_length)
    w.add_embedding_length(spec.embd)
    w.add_block_count(spec.layers)
    if "feed_forward_length" not in extra:
        w.add_feed_forward_length(spec.ff)
    w.add_head_count(spec.heads)
    if "attention.head_count_kv" not in extra:
        w.add_head_count_kv(spec.heads_kv)
    if spec.head_dim and "attention.key_length" not in extra:
        w.add_key_length(spec.head_dim)
        w.add_value_length(spec.head_dim)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(10000.0)
    w.add_expert_count(spec.experts)
    w.add_expert_used_count(spec.top_k)
    if layout.uses_expert_ff_key:
        w.add_expert_feed_forward_length(spec.ff)
    for key, value in extra.items():
        full = f"{layout.name}.{key}"
        if isinstance(value, float):
            w.add_float32(full, value)
        else:
            w.add_uint32(full, value)
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list(list(VOCAB.tokens))
    w.add_token_scores(list(VOCAB.scores))
    w.add_token_types(list(VOCAB.token_types))
    w.add_bos_token_id(synth_vocab.BOS_ID)
    w.add_eos_token_id(synth_vocab.EOS_ID)
    w.add_eot_token_id(synth_vocab.IM_END_ID)
    w.add_unk_token_id(synth_vocab.UNK_ID)
    w.add_add_bos_token(True)
    w.add_chat_template(synth_vocab.CHAT_TEMPLATE)
