"""What the patched graph feeds MUL_MAT_ID, read back through cb_eval (the id planes the device
cache store's dc_store_route writes). For batches a scheduler may offload (>= 32 tokens): slot
ids are distinct within every token (resident experts at their slots, the rest at sink slots)
and the cold path takes distinct non-resident ids. For small batches, which ggml-cpu computes, each
path names only its own rows and -1 elsewhere (no row computed). Every routing position is
gathered back from the one path that computed it."""
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
    for small, batch_topk, batch_hot in zip((False, True), topk, hot):
        for experts, slots in zip(batch_topk, batch_hot):
            if not small:
                assert len(set(slots)) == len(slots)        # distinct within the token
            for pos, (e, s) in enumerate(zip(experts, slots)):
                want = _resident_slot(layer, e, n_slots)
                miss = -1 if small else n_slots + pos       # cpu-slots: ggml-cpu skips -1
                assert s == (want if want is not None else miss)


def _check_pick(experts, cold_ids, pick, layer, n_slots):
    k = len(experts)
    for pos, (e, p) in enumerate(zip(experts, pick)):
        if _resident_slot(layer, e, n_slots) is None:
            assert p == pos and cold_ids[pos] == e     # a miss: the cold path, same position
        else:
            assert p == k + pos                        # a hit: the slot path, same position


@pytest.mark.parametrize("layer", range(4))
def test_no_rows_for_hits_in_the_small_batch(ids, layer):
    n_slots = ids["n_slots"]
    cold = ids["seen"][f"ffn_moe_cold_ids-{layer}"]
    assert len(cold) == 2                                   # [prefill, decode]
    (experts,) = ids["seen"][f"ffn_moe_topk-{layer}"][1]
    (cold_ids,) = cold[1]
    assert cold_ids == [e if _resident_slot(layer, e, n_slots) is None else -1 for e in experts]
    _check_pick(experts, cold_ids, ids["seen"][f"ffn_moe_pick-{layer}"][1][0], layer, n_slots)


@pytest.mark.parametrize("layer", range(4))
def test_distinct_non_resident_ids_for_the_large_batch(ids, layer):
    """The prompt batch (>= 32 tokens, which a GPU scheduler offloads): cold ids are distinct
    within every token, keep every non-resident routed expert, and name no resident expert, so
    the scheduler copies no resident expert's bytes; each routed miss is gathered back from the
    position that computed it."""
    n_slots = ids["n_slots"]
    topk = ids["seen"][f"ffn_moe_topk-{layer}"][0]
    cold = ids["seen"][f"ffn_moe_cold_ids-{layer}"][0]
    pick = ids["seen"][f"ffn_moe_pick-{layer}"][0]
    assert len(pick) == len(cold) == len(topk) == len(PROMPT)
    batch_misses = {e for experts in topk for e in experts
                    if _resident_slot(layer, e, n_slots) is None}
    n_hits = 0
    for experts, cold_ids, where in zip(topk, cold, pick):
        assert len(set(cold_ids)) == len(cold_ids) == len(experts)
        assert not [e for e in cold_ids if _resident_slot(layer, e, n_slots) is not None]
        # fillers are other tokens' misses while there are enough: no extra expert's bytes
        if len(batch_misses) >= len(experts):
            assert set(cold_ids) <= batch_misses
        _check_pick(experts, cold_ids, where, layer, n_slots)
        n_hits += sum(_resident_slot(layer, e, n_slots) is not None for e in experts)
    assert n_hits > 0                                       # the replacement was exercised
