"""What the patched graph feeds MUL_MAT_ID, read back through cb_eval: slot ids are distinct
within every token (resident experts at their slots, the rest at sink slots), and the cold
path's anchors appear only for small batches over plain host buffers."""
from __future__ import annotations

import numpy as np
import pytest

from tests.native.conftest import run_child

PROMPT = [int(t) for t in np.random.default_rng(1).integers(20, 1500, 40)]  # >= 32: offloadable


@pytest.fixture(scope="module")
def ids(native_build, q8_model):
    return run_child("ids", {"model": str(q8_model), "capacity": 2_000_000,
                             "prompt_tokens": PROMPT}, native_build.lib_dir)


def _resident_slot(layer: int, expert: int, n_slots: int) -> int | None:
    slot = layer * 8 + expert // 2          # native_child.mode_ids: even experts resident
    return slot if expert % 2 == 0 and slot < n_slots else None


@pytest.mark.parametrize("layer", range(4))
def test_slot_ids(ids, layer):
    n_slots = ids["n_slots"]
    topk = ids["seen"][f"ffn_moe_topk-{layer}"]           # [prefill, decode]
    hot = ids["seen"][f"ffn_moe_hot_ids-{layer}"]
    assert [len(t) for t in topk] == [len(PROMPT), 1] and len(hot) == 2
    for batch_topk, batch_hot in zip(topk, hot):
        for experts, slots in zip(batch_topk, batch_hot):
            assert len(set(slots)) == len(slots)            # distinct within the token
            for pos, (e, s) in enumerate(zip(experts, slots)):
                want = _resident_slot(layer, e, n_slots)
                assert s == (want if want is not None else n_slots + pos)


@pytest.mark.parametrize("layer", range(4))
def test_anchors_only_for_small_batches(ids, layer):
    n_slots = ids["n_slots"]
    cold = ids["seen"].get(f"ffn_moe_cold_ids-{layer}", [])
    assert len(cold) == 1                                   # the decode step, not the prompt
    (experts,) = ids["seen"][f"ffn_moe_topk-{layer}"][1]
    (cold_ids,) = cold[0]
    misses = [e for e in experts if _resident_slot(layer, e, n_slots) is None]
    anchor = max(misses) if misses else experts[0]
    assert cold_ids == [e if e in misses else anchor for e in experts]
