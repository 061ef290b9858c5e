"""With cpu-slots, the hot/cold split gives the logits of the unpatched graph and the same
greedy tokens, at every cache size (llm.c style: the max difference is printed)."""
from __future__ import annotations

import numpy as np
import pytest

from gguf_tools.facts import read_model_facts
from tests.native.conftest import Q8_SPEC, run_child

PROMPT = [int(t) for t in np.random.default_rng(0).integers(20, 1500, 40)]
GREEDY = 12


def _logits(model, lib_dir, tmp_path, name, capacity=None, fill="all", n_expert=16):
    res = run_child("logits", {"model": str(model), "capacity": capacity, "fill": fill,
                               "n_expert": n_expert, "prompt_tokens": PROMPT, "greedy": GREEDY,
                               "out": str(tmp_path / f"{name}.npy")}, lib_dir)
    return np.load(res["logits_npy"]), res


@pytest.fixture(scope="module")
def reference(native_build, q8_model, tmp_path_factory):
    """The patched build with no cache registered: the unpatched graph, same kernels."""
    return _logits(q8_model, native_build.lib_dir, tmp_path_factory.mktemp("ref"), "ref")


@pytest.mark.parametrize("fraction, fill", [(0.0, "all"), (0.1, "even"), (0.5, "even"),
                                            (0.5, "all"), (1.0, "all")])
def test_split_matches_unpatched(native_build, q8_model, reference, tmp_path, fraction, fill):
    facts = read_model_facts(q8_model)
    capacity = int(fraction * facts.total_expert_bytes)
    ref_logits, ref = reference
    logits, res = _logits(q8_model, native_build.lib_dir, tmp_path, "hot", capacity, fill)
    diff = float(np.abs(logits - ref_logits).max())
    print(f"cpu-slots {fraction:.0%} of experts ({res['resident']} resident, fill {fill}): "
          f"max abs logit diff {diff:.3g}")
    expected = {0.0: 0, 1.0: facts.n_expert * len(facts.moe_layers)}
    if fraction in expected:
        assert res["resident"] == expected[fraction]
    else:
        assert 0 < res["resident"] < facts.n_expert * len(facts.moe_layers)
    assert diff <= 1e-5
    assert res["greedy"] == ref["greedy"]


def test_slots_are_really_used(native_build, q8_model, reference, tmp_path):
    """Slots holding the wrong experts change the output: the hot path reads the slots."""
    facts = read_model_facts(q8_model)
    ref_logits, _ = reference
    logits, res = _logits(q8_model, native_build.lib_dir, tmp_path, "shifted",
                          facts.total_expert_bytes, "shifted")
    diff = float(np.abs(logits - ref_logits).max())
    print(f"slots with shifted experts: max abs logit diff {diff:.3g} (must be large)")
    assert diff > 1e-2


def test_patched_build_matches_the_stock_wheel(native_build, q8_model, reference, tmp_path):
    """The patched build with every expert in slots vs llama-cpp-python's own libraries."""
    facts = read_model_facts(q8_model)
    stock_logits, stock = _logits(q8_model, None, tmp_path, "stock")
    assert stock["lib"] != native_build.lib_dir
    logits, res = _logits(q8_model, native_build.lib_dir, tmp_path, "all",
                          facts.total_expert_bytes, "all")
    ref_logits, _ = reference
    diff_ref = float(np.abs(ref_logits - stock_logits).max())
    diff = float(np.abs(logits - stock_logits).max())
    print(f"stock wheel vs patched (no cache): {diff_ref:.3g}; vs patched (all slots): "
          f"{diff:.3g}")
    assert diff <= 1e-3
    assert res["greedy"] == stock["greedy"]


def test_f32_model_every_size(native_build, tiny_model, tiny_spec, tmp_path):
    facts = read_model_facts(tiny_model)
    ref_logits, ref = _logits(tiny_model, native_build.lib_dir, tmp_path, "ref32",
                              n_expert=tiny_spec.experts)
    for fraction in (0.25, 1.0):
        logits, res = _logits(tiny_model, native_build.lib_dir, tmp_path, f"f32-{fraction}",
                              int(fraction * facts.total_expert_bytes), "all",
                              n_expert=tiny_spec.experts)
        diff = float(np.abs(logits - ref_logits).max())
        print(f"f32 model, {fraction:.0%} in slots: max abs logit diff {diff:.3g}")
        assert diff <= 1e-5 and res["greedy"] == ref["greedy"]


assert Q8_SPEC.experts == 16
