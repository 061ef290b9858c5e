"""Synthetic companions of a synthetic model: a reranker GGUF and a LoRA adapter GGUF.

A reranker here is a synthetic MoE model whose pooling type is ``rank`` and which carries a
rerank prompt (``tokenizer.chat_template.rerank``, with ``{query}`` and ``{document}``, as
Qwen3-Reranker GGUFs do). llama.cpp (0.3.36) loads a classifier head (``cls``,
``cls.output``) only for dense architectures (bert, jina-bert-v2, modern-bert, neo-bert,
qwen3, qwen3vl), and moe-offload runs mixture-of-experts models only; for the MoE archs
``build_pooling(LLAMA_POOLING_TYPE_RANK)`` has no head to apply and the score is channel 0 of
the last token's normalised hidden state (``n_cls_out`` = 1). That is a real number llama.cpp
computes per (query, document), deterministic and different per document: enough to test the
route's shape, order and counts, not a judgement of relevance.

A LoRA adapter (``general.type = adapter``, ``adapter.type = lora``) holds ``NAME.lora_a``
(ggml shape ``(ne0, rank)``) and ``NAME.lora_b`` (``(rank, ne1)``) for each adapted weight
``NAME`` of the base model (ggml shape ``(ne0, ne1)``), as llama.cpp's
``llama_adapter_lora_init`` checks them; its delta is ``scale * B @ A`` (alpha = rank).

    write_synthetic_reranker("rerank.gguf", spec)
    write_synthetic_lora("lora.gguf", spec)                      # attn_q, attn_v, output
    write_synthetic_lora("experts.gguf", spec, targets=("ffn_up_exps",))
"""
from __future__ import annotations

import os
import zlib
from pathlib import Path

import numpy as np
from gguf import GGUFWriter

from gguf_tools.synth import published_gguf, write_synthetic_model
from gguf_tools.synth_layouts import LAYOUTS, tensor_plans
from gguf_tools.synth_spec import SynthSpec
from runtime.atomic_write import AtomicTarget

RANK_POOLING = 4          # LLAMA_POOLING_TYPE_RANK
RERANK_TEMPLATE = ("<|im_start|>system\nJudge whether the Document meets the requirements based "
                   "on the Query. Answer only \"yes\" or \"no\".<|im_end|>\n<|im_start|>user\n"
                   "<Query>: {query}\n<Document>: {document}<|im_end|>\n"
                   "<|im_start|>assistant\n")
LORA_TARGETS = ("attn_q", "attn_v", "output")   # dense weights: no expert is touched


def write_synthetic_reranker(path: str | os.PathLike[str], spec: SynthSpec) -> Path:
    """``spec``'s model with pooling type ``rank`` and a rerank prompt."""
    arch = LAYOUTS[spec.arch].name
    return write_synthetic_model(path, spec, metadata={
        f"{arch}.pooling_type": RANK_POOLING, "tokenizer.chat_template.rerank": RERANK_TEMPLATE})


def write_synthetic_lora(path: str | os.PathLike[str], spec: SynthSpec, *,
                         targets: tuple[str, ...] = LORA_TARGETS, rank: int = 4,
                         std: float = 0.5, seed: int = 0) -> Path:
    """A LoRA adapter for the model ``spec`` describes: random ``lora_a``/``lora_b`` (f32,
    N(0, std)) for every weight whose name is ``TARGET.weight`` or ends ``.TARGET.weight``.
    An expert weight (3D) gets one pair per expert (ggml ``(ne0, rank, n_expert)``)."""
    plans = [p for p in tensor_plans(spec) if any(
        p.name == f"{t}.weight" or p.name.endswith(f".{t}.weight") for t in targets)]
    if not plans:
        raise ValueError(f"no weight of a {spec.arch} model matches {', '.join(targets)}")
    out = Path(path)
    target = AtomicTarget(out)
    writer = GGUFWriter(target.tmp, LAYOUTS[spec.arch].name)
    with published_gguf(target, writer):
        writer.add_string("general.type", "adapter")
        writer.add_string("adapter.type", "lora")
        writer.add_float32("adapter.lora.alpha", float(rank))   # delta scale: scale * alpha/rank
        for plan in plans:
            base = plan.name.removesuffix(".weight") + ".weight"
            rng = np.random.default_rng([seed, zlib.crc32(base.encode())])
            ne0, ne1, *experts = plan.shape                      # ggml order
            lead = tuple(reversed(experts))                      # numpy: outermost first
            a = rng.standard_normal((*lead, rank, ne0), dtype=np.float32) * std
            b = rng.standard_normal((*lead, ne1, rank), dtype=np.float32) * std
            writer.add_tensor(base + ".lora_a", a)
            writer.add_tensor(base + ".lora_b", b)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
    return out
