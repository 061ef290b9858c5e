"""Synthetic model writer: refusals, determinism, atomic writes, skewed routers."""
from __future__ import annotations

import hashlib
import os
from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFReader

from gguf_tools.synth import (SynthSpec, SynthSpecError, planned_data_bytes, tensor_plans,
                              write_synthetic_model)


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"top_k": 9, "experts": 8}, "--top-k 9 is more than --experts 8"),
    ({"dtype": "q4_0", "ff": 40}, "Q4_0 packs rows in blocks of 32"),
    ({"dtype": "q8_0", "embd": 48, "heads": 4}, "multiples of 32"),
    ({"dtype": "q4_k_m", "embd": 64, "ff": 32}, "blocks of 256"),
    ({"experts": 0}, "--experts must be at least 1"),
    ({"layers": 0}, "--layers must be at least 1"),
    ({"heads": 4, "heads_kv": 3}, "not a multiple of --heads-kv"),
    ({"embd": 66, "heads": 4}, "not a multiple of --heads"),
    ({"skew": -1.0}, "--skew must be"),
    ({"arch": "nope"}, "unknown arch"),
    ({"dtype": "q3_x"}, "unknown dtype"),
    ({"arch": "deepseek2"}, "needs --shared-experts of at least 1"),
    ({"arch": "qwen3moe", "dense_layers": 1}, "no leading dense layers"),
    ({"arch": "deepseek2", "shared_experts": 1, "dense_layers": 4}, "at least one MoE layer"),
    ({"arch": "llama", "gate_up_merged": True}, "cannot load a merged ffn_gate_up_exps"),
    ({"arch": "olmoe", "head_dim": 32}, "--arch olmoe needs"),
    ({"arch": "deepseek2", "shared_experts": 1, "gate_up_merged": True, "expert_scales": True},
     "needs separate gate and up"),
])
def test_impossible_shapes_are_refused(kwargs: dict, message: str) -> None:
    with pytest.raises(SynthSpecError, match=message.replace("-", r"\-")) as info:
        SynthSpec(**kwargs)
    assert "\n" not in str(info.value)


def test_same_seed_same_bytes_other_seed_other_bytes(tmp_path: Path) -> None:
    spec = SynthSpec(dtype="q8_0", skew=1.0, seed=7)
    a = write_synthetic_model(tmp_path / "a.gguf", spec)
    b = write_synthetic_model(tmp_path / "b.gguf", spec)
    c = write_synthetic_model(tmp_path / "c.gguf", SynthSpec(dtype="q8_0", skew=1.0, seed=8))
    assert _sha256(a) == _sha256(b)
    assert _sha256(a) != _sha256(c)
    assert a.stat().st_size == c.stat().st_size


def test_file_matches_the_plan(tmp_path: Path) -> None:
    spec = SynthSpec(arch="gpt-oss", dtype="q4_0", expert_scales=True)
    reported: list[int] = []
    path = write_synthetic_model(tmp_path / "m.gguf", spec, progress=reported.append)
    assert sum(reported) == planned_data_bytes(spec)
    reader = GGUFReader(path)
    plans = tensor_plans(spec)
    assert [t.name for t in reader.tensors] == [p.name for p in plans]
    for t, p in zip(reader.tensors, plans):
        assert tuple(int(d) for d in t.shape) == p.shape
        assert t.tensor_type == p.qtype
    assert path.stat().st_size - reader.data_offset == planned_data_bytes(spec)
    assert reader.get_field("tokenizer.chat_template").contents().startswith("{% for message")


def test_interrupted_write_leaves_nothing(tmp_path: Path) -> None:
    out = tmp_path / "m.gguf"
    out.write_bytes(b"previous contents")
    calls = []

    def interrupt(n: int) -> None:
        calls.append(n)
        if len(calls) == 5:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        write_synthetic_model(out, SynthSpec(), progress=interrupt)
    assert out.read_bytes() == b"previous contents"     # the old file is untouched
    assert sorted(os.listdir(tmp_path)) == ["m.gguf"]   # and no temporary file is left


def _popularity(path: Path, spec: SynthSpec, layer: int, n_tokens: int = 4000) -> np.ndarray:
    """Share of top-k picks per expert for random normalized hidden states with channel 0 = 1
    (what the residual stream looks like to the router in these models)."""
    reader = GGUFReader(path)
    router = next(t for t in reader.tensors if t.name == f"blk.{layer}.ffn_gate_inp.weight")
    w = np.asarray(router.data, dtype=np.float32)                  # (n_expert, n_embd)
    x = np.random.default_rng(123).standard_normal((n_tokens, spec.embd), dtype=np.float32)
    x[:, 0] = 1.0
    x /= np.sqrt((x * x).mean(axis=1, keepdims=True))
    top = np.argsort(-(x @ w.T), axis=1)[:, :spec.top_k]          # (n_tokens, top_k)
    return np.bincount(top.ravel(), minlength=spec.experts) / top.size


def test_skew_makes_popularity_uneven_and_different_per_layer(tmp_path: Path) -> None:
    flat = SynthSpec(layers=4, experts=16, top_k=2, skew=0.0)
    skewed = SynthSpec(layers=4, experts=16, top_k=2, skew=1.5)
    flat_path = write_synthetic_model(tmp_path / "flat.gguf", flat)
    skew_path = write_synthetic_model(tmp_path / "skew.gguf", skewed)
    flat_pop = [_popularity(flat_path, flat, layer) for layer in range(4)]
    skew_pop = [_popularity(skew_path, skewed, layer) for layer in range(4)]
    for f, s in zip(flat_pop, skew_pop):
        assert s.max() > 2 * f.max()              # a few experts take much more than their share
        assert (s > 0).sum() >= 4                 # but routing still spreads over experts
    assert len({int(np.argmax(s)) for s in skew_pop}) > 1   # the favourite differs per layer


@pytest.mark.parametrize("qtype_name", ["Q8_0", "Q4_0", "MXFP4", "Q4_K", "Q5_K", "Q6_K"])
def test_random_blocks_dequantize_to_the_requested_spread(qtype_name: str) -> None:
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    from gguf_tools.synth_blocks import random_blocks

    qtype = GGMLQuantizationType[qtype_name]
    blocks = random_blocks(np.random.default_rng(1), qtype, 64, 512, std=0.05, zero_row0=True)
    w = dequantize(blocks, qtype)                         # (64, 512) float32
    assert w.shape == (64, 512) and np.isfinite(w).all()
    assert np.all(w[0] == 0.0)                            # row 0 (output channel 0) is exactly 0
    assert abs(float(w[1:].mean())) < 0.005
    assert 0.035 < float(w[1:].std()) < 0.065             # MXFP4 scales are powers of two


def test_q4_k_embedding_blocks_keep_the_bias_channel() -> None:
    """An embedding table in Q4_K (token_embd of a Q4_K_M preset): column 0 is one constant
    ~1.0 in every row (the bias channel), the rest spreads like N(0, 1)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    from gguf_tools.synth_blocks import random_blocks

    q4_k = GGMLQuantizationType.Q4_K
    w = dequantize(random_blocks(np.random.default_rng(2), q4_k, 300, 512, std=1.0,
                                 unit_col0=True), q4_k)   # (300, 512)
    assert np.all(w[:, 0] == w[0, 0]) and abs(float(w[0, 0]) - 1.0) < 1e-3
    assert abs(float(w[:, 1:].mean())) < 0.02 and 0.9 < float(w[:, 1:].std()) < 1.1
    with pytest.raises(ValueError, match="unit_col0 needs Q4_K"):
        random_blocks(np.random.default_rng(2), GGMLQuantizationType.Q6_K, 1, 256, std=1.0,
                      unit_col0=True)


def test_streaming_write_keeps_memory_bounded(tmp_path: Path) -> None:
    import tracemalloc

    spec = SynthSpec(layers=4, experts=32, embd=512, ff=512, heads=8, heads_kv=4, dtype="q8_0")
    tracemalloc.start()
    try:
        path = write_synthetic_model(tmp_path / "mid.gguf", spec)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    size = path.stat().st_size
    assert size > 100 * 2**20
    # the largest slab is one 512 x 512 expert or the 512-wide embedding table, a few MiB
    assert peak < 16 * 2**20, f"peak {peak / 2**20:.1f} MiB while writing {size / 2**20:.0f} MiB"


def test_real_shapes_plan_the_documented_expert_bytes() -> None:
    """Qwen3-30B-A3B's shapes (models.md): one expert is 3 x 2048 x 768 weights."""
    from gguf_tools.synth import tensor_nbytes

    for dtype, per_expert in (("q8_0", 3 * 2048 * 768 // 32 * 34),
                              ("q4_k", 3 * 2048 * 768 // 256 * 144)):
        spec = SynthSpec(layers=48, experts=128, top_k=8, embd=2048, ff=768, heads=32,
                         heads_kv=4, head_dim=128, dtype=dtype)
        expert = [p for p in tensor_plans(spec) if "_exps.weight" in p.name]
        assert len(expert) == 48 * 3
        assert sum(tensor_nbytes(p) for p in expert) == per_expert * 128 * 48
