"""The expert index's byte ranges are exactly the bytes gguf.GGUFReader gives for each expert."""
from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q, GGUFReader, GGUFWriter
from gguf.quants import quantize
from hypothesis import given, settings, strategies as st

from gguf_tools.expert_index import ExpertIndex
from gguf_tools.expert_view import ExpertView
from gguf_tools.facts import EXPERT_TENSOR_RE, read_model_facts
from gguf_tools.synth import SynthSpec, _slab_values, tensor_plans, write_synthetic_model
from runtime.errors import UserError
from tests.conftest import write_dense_gguf


def assert_index_matches_reader(path: Path) -> ExpertIndex:
    """Every expert range equals GGUFReader's bytes for that expert; totals add up."""
    index = ExpertIndex.open(path)
    facts = index.facts
    reader = GGUFReader(path)
    file_bytes = path.read_bytes()
    by_layer: dict[int, list] = {}
    for t in reader.tensors:
        m = EXPERT_TENSOR_RE.match(t.name)
        if m:
            by_layer.setdefault(int(m["layer"]), []).append(t)
    assert facts.moe_layers == tuple(sorted(by_layer))
    for layer in range(facts.n_layer):
        if layer not in by_layer:
            assert facts.expert_bytes[layer] == 0
            continue
        tensors = {t.name: t for t in by_layer[layer]}
        for expert in range(facts.n_expert):
            ranges = index.ranges(layer, expert)
            assert {r.tensor for r in ranges} == set(tensors)
            assert sum(r.length for r in ranges) == facts.expert_bytes[layer]
            for r in ranges:
                expected = np.ascontiguousarray(tensors[r.tensor].data[expert]).tobytes()
                assert file_bytes[r.offset:r.end] == expected, (r, layer, expert)
    all_bytes = sum(int(t.n_bytes) for t in reader.tensors)
    assert facts.total_expert_bytes == sum(facts.expert_bytes) * facts.n_expert
    assert facts.total_expert_bytes + facts.dense_bytes == all_bytes
    assert facts.file_bytes == path.stat().st_size
    assert facts.tensor_types == {t.name: t.tensor_type.name for t in reader.tensors}
    return index


_SMALL_DTYPES = ["f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "mxfp4"]


@st.composite
def synth_specs(draw: st.DrawFn) -> SynthSpec:
    experts = draw(st.integers(1, 6))
    k_quant = draw(st.booleans()) and draw(st.booleans())   # 1 in 4: 256-wide K-quant models
    dtype = draw(st.sampled_from(["q4_k", "q6_k", "q4_k_m"] if k_quant else _SMALL_DTYPES))
    arch = draw(st.sampled_from(["qwen3moe", "llama", "gpt-oss", "deepseek2", "olmoe"]))
    layers = draw(st.integers(1, 3))
    extra = {}
    if arch == "deepseek2":   # dense-first layers, shared experts, merged gate_up
        merged = draw(st.booleans())
        extra = {"dense_layers": draw(st.integers(0, layers - 1)), "gate_up_merged": merged,
                 "shared_experts": draw(st.integers(1, 2))}
    scales = draw(st.booleans()) and not extra.get("gate_up_merged")
    return SynthSpec(
        arch=arch, layers=layers, experts=experts, top_k=draw(st.integers(1, experts)),
        embd=256 if k_quant else 64, ff=256 if k_quant else draw(st.sampled_from([32, 64])),
        dtype=dtype, seed=draw(st.integers(0, 2**16)), expert_scales=scales, **extra)


@settings(max_examples=30, deadline=None, derandomize=True, database=None)
@given(spec=synth_specs())
def test_index_ranges_equal_reader_bytes(spec: SynthSpec) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = write_synthetic_model(Path(tmp) / "m.gguf", spec)
        index = assert_index_matches_reader(path)
        f = index.facts
        assert (f.arch, f.n_layer, f.n_expert, f.n_expert_used, f.n_embd, f.n_ff_exp) == (
            spec.arch, spec.layers, spec.experts, spec.top_k, spec.embd, spec.ff)
        assert f.moe_layers == tuple(range(spec.dense_layers, spec.layers))
        assert f.n_shared_experts == spec.shared_experts
        del index


def test_per_layer_quant_types_give_per_layer_expert_bytes(synth_model_factory) -> None:
    spec = SynthSpec(layers=8, experts=4, embd=256, ff=256, dtype="q4_k_m")
    facts = read_model_facts(synth_model_factory(spec))
    q4k, q6k = 144 * 256 * 256 // 256, 210 * 256 * 256 // 256     # bytes of one 256x256 matrix
    # Q4_K_M keeps more bits (Q6_K down) in the first and last eighth and every third layer
    assert facts.expert_bytes == tuple(2 * q4k + (q6k if layer in (0, 3, 6, 7) else q4k)
                                       for layer in range(8))


def _write_mixed_layout(path: Path) -> None:
    """A deepseek-style file: dense layer 0, then MoE layers with a merged gate_up tensor,
    per-expert biases and shared experts. (Index-only: llama.cpp needs more tensors to run it.)"""
    n_embd, n_ff, n_expert, rng = 64, 32, 4, np.random.default_rng(0)
    w = GGUFWriter(path, "deepseek2")
    w.add_block_count(3)
    w.add_expert_count(n_expert)
    w.add_expert_used_count(2)
    w.add_expert_shared_count(1)
    w.add_embedding_length(n_embd)
    w.add_context_length(1024)

    def add(name: str, np_shape: tuple[int, ...], qtype: Q = Q.F32) -> None:
        values = rng.standard_normal(np_shape).astype(np.float32)
        w.add_tensor(name, quantize(values, qtype), raw_dtype=qtype)

    add("token_embd.weight", (100, n_embd), Q.Q8_0)
    add("blk.0.ffn_gate.weight", (n_ff * 4, n_embd))
    add("blk.0.ffn_up.weight", (n_ff * 4, n_embd))
    add("blk.0.ffn_down.weight", (n_embd, n_ff * 4))
    for layer, qtype in ((1, Q.Q8_0), (2, Q.Q4_0)):
        p = f"blk.{layer}."
        add(p + "ffn_gate_inp.weight", (n_expert, n_embd))
        add(p + "ffn_gate_up_exps.weight", (n_expert, 2 * n_ff, n_embd), qtype)
        add(p + "ffn_gate_up_exps.bias", (n_expert, 2 * n_ff))
        add(p + "ffn_down_exps.weight", (n_expert, n_embd, n_ff), qtype)
        add(p + "ffn_down_exps.bias", (n_expert, n_embd))
        add(p + "ffn_gate_shexp.weight", (n_ff, n_embd))
        add(p + "ffn_up_shexp.weight", (n_ff, n_embd))
        add(p + "ffn_down_shexp.weight", (n_embd, n_ff))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_dense_first_layers_merged_gate_up_biases_and_shared_experts(tmp_path: Path) -> None:
    path = tmp_path / "mixed.gguf"
    _write_mixed_layout(path)
    index = assert_index_matches_reader(path)
    f = index.facts
    assert f.moe_layers == (1, 2)
    assert f.n_shared_experts == 1
    assert f.n_ff_exp == 32
    # layer 1 (Q8_0): gate_up 64 rows x 64 + bias 64 f32 + down 64 rows x 32 + bias 64 f32
    assert f.expert_bytes == (0, 64 * 68 + 64 * 4 + 64 * 34 + 64 * 4,
                              64 * 36 + 64 * 4 + 64 * 18 + 64 * 4)
    assert [r.tensor for r in index.ranges(2, 3)] == [
        "blk.2.ffn_gate_up_exps.weight", "blk.2.ffn_gate_up_exps.bias",
        "blk.2.ffn_down_exps.weight", "blk.2.ffn_down_exps.bias"]
    with pytest.raises(KeyError):
        index.ranges(0, 0)
    with pytest.raises(IndexError):
        index.ranges(1, 4)


@pytest.mark.parametrize("dtype", ["f32", "q8_0", "q4_k_m"])
def test_expert_view_is_zero_copy_read_only_and_dequantizes(synth_model_factory, dtype) -> None:
    wide = dtype == "q4_k_m"
    spec = SynthSpec(arch="gpt-oss", layers=2, experts=4, dtype=dtype, expert_scales=True,
                     embd=256 if wide else 64, ff=256 if wide else 32)
    path = synth_model_factory(spec)
    reader = GGUFReader(path)
    tensors = {t.name: t for t in reader.tensors}
    with ExpertView.open(path) as view:
        raw = view.expert_bytes(1, 2)
        for name, arr in raw.items():
            assert not arr.flags.writeable and not arr.flags.owndata
            assert arr.tobytes() == np.ascontiguousarray(tensors[name].data[2]).tobytes()
        weights = view.dequantize(1, 2)
        assert set(weights) == set(raw)
        gate = weights["blk.1.ffn_gate_exps.weight"].values
        assert gate.shape == (spec.ff, spec.embd) and gate.dtype == np.float32
        assert np.isfinite(gate).all() and gate.std() > 0
        if dtype == "f32":   # bit-exact: the seeded generator's values for expert 2
            plan = next(p for p in tensor_plans(spec) if p.name == "blk.1.ffn_gate_exps.weight")
            np.testing.assert_array_equal(gate, _slab_values(spec, plan, 2, gate.shape))
        assert weights["blk.1.ffn_down_exps.bias"].values.shape == (spec.embd,)
        assert weights["blk.1.ffn_down_exps.scale"].values.shape == ()
        del raw, weights


def test_dense_model_is_refused(tmp_path: Path) -> None:
    path = write_dense_gguf(tmp_path / "dense.gguf")
    with pytest.raises(UserError, match="not a mixture-of-experts model"):
        read_model_facts(path)
    assert read_model_facts(path, require_moe=False).moe_layers == ()
