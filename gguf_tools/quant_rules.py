"""Each tensor's type as llama-quantize picks it, for the file types synthetic presets write.

A transcription of ``llama_tensor_get_type`` in llama.cpp's ``src/llama-quant.cpp`` (as vendored
by llama-cpp-python 0.3.36), for Q8_0 and Q4_K_M without an imatrix or overrides, and only the
parts that reach the tensors of the synthetic layouts (synth_layouts.py). Published GGUFs made by
``llama-quantize`` without per-tensor overrides carry exactly these types, which is what lets a
synthetic file have the real file's bytes per layer.

Q4_K_M, by tensor (``more_bits(i, n)``: the first and last eighth of the layers and every third
one between, see ``more_bits``):

    output.weight                       Q6_K (Q8_0 when rows are not a multiple of 256)
    token_embd.weight                   Q4_K
    attn_v / attn_kv_b                  Q6_K on more_bits layers, else Q4_K; Q8_0 with 8 experts
    attn_k                              Q4_K; Q8_0 with 8 experts
    attn_output                         Q4_K; Q5_K with 8 experts
    ffn_down* (dense, _shexp, _exps)    Q6_K on more_bits layers, else Q4_K
    everything else 2D/3D               Q4_K
    routers (ffn_gate_inp), norms,      kept (F32)
    biases, any 1D tensor

Q8_0: every 2D/3D weight Q8_0, the same kept tensors F32. Rows that the chosen type cannot hold
(K-quants pack 256 weights) fall back: Q4_K -> Q5_0, Q5_K -> Q5_1, Q6_K -> Q8_0, and F16 when a
32-block type cannot hold them either (``tensor_type_fallback``).
"""
from __future__ import annotations

import re

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as Q

RULE_DTYPES: tuple[str, ...] = ("q8_0", "q4_k_m")   # file types transcribed here
_FALLBACK = {Q.Q4_K: Q.Q5_0, Q.Q5_K: Q.Q5_1, Q.Q6_K: Q.Q8_0}
_LAYER_RE = re.compile(r"^blk\.(\d+)\.")


def more_bits(layer: int, n_layer: int) -> bool:
    """llama-quantize's ``use_more_bits``: the layers Q4_K_M gives a larger type."""
    return layer < n_layer // 8 or layer >= 7 * n_layer // 8 or (layer - n_layer // 8) % 3 == 2


def is_quantized_tensor(name: str, shape: tuple[int, ...]) -> bool:
    """Whether llama-quantize changes this tensor's type (``tensor_allows_quantization``)."""
    return (len(shape) >= 2 and name.endswith("weight") and "_norm.weight" not in name
            and "ffn_gate_inp.weight" not in name)


def llama_quantize_type(name: str, shape: tuple[int, ...], dtype: str, *, n_layer: int,
                        n_expert: int) -> Q | None:
    """The type llama-quantize gives tensor ``name`` (ggml ``shape``) in a ``dtype`` file, or
    None where it keeps the tensor's own type (routers, norms, biases: F32 in converted files)."""
    if dtype not in RULE_DTYPES:
        raise ValueError(f"no llama-quantize rules for {dtype!r} (have {', '.join(RULE_DTYPES)})")
    if not is_quantized_tensor(name, shape):
        return None
    ne0 = shape[0]
    if dtype == "q8_0":
        return _fallback(Q.Q8_0, ne0)
    match = _LAYER_RE.match(name)
    layer = int(match.group(1)) if match else -1
    # one attn_v-like tensor per layer here, so llama.cpp's running i_attention_wv == layer
    if name == "output.weight":
        qtype = Q.Q8_0 if ne0 % 256 else Q.Q6_K
    elif "attn_v.weight" in name or "attn_kv_b.weight" in name or "attn_qkv.weight" in name:
        qtype = Q.Q8_0 if n_expert == 8 else Q.Q6_K if more_bits(layer, n_layer) else Q.Q4_K
    elif "attn_k.weight" in name:
        qtype = Q.Q8_0 if n_expert == 8 else Q.Q4_K
    elif "attn_output.weight" in name:
        qtype = Q.Q5_K if n_expert == 8 else Q.Q4_K
    elif "ffn_down" in name:
        qtype = Q.Q6_K if more_bits(layer, n_layer) else Q.Q4_K
    else:
        qtype = Q.Q4_K
    return _fallback(qtype, ne0)


def _fallback(qtype: Q, ne0: int) -> Q:
    block = GGML_QUANT_SIZES[qtype][0]
    if ne0 % block == 0:
        return qtype
    qtype = _FALLBACK.get(qtype, qtype)
    return qtype if ne0 % GGML_QUANT_SIZES[qtype][0] == 0 else Q.F16
