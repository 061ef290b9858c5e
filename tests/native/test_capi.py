"""The device cache store's C API (dc_store_*) through cffi
(runtime/native/device_cache_store.py), in a process whose libllama is the patched build."""
from __future__ import annotations

import pytest

from gguf_tools.expert_index import ExpertIndex
from tests.native.conftest import run_child


@pytest.fixture(scope="module")
def capi(native_build, q8_model):
    n_used = ExpertIndex.open(q8_model).facts.n_expert_used
    return run_child("capi", {"model": str(q8_model), "capacity": 200_000, "n_used": n_used},
                     native_build.lib_dir)


def test_sizes_follow_the_model(capi, q8_model):
    index = ExpertIndex.open(q8_model)
    expert_bytes = index.expert_bytes(0)
    assert capi["n_layer"] == 4 and capi["n_pool"] == 1
    assert capi["layers"] == [[0, expert_bytes]] * 4
    n_sink = index.facts.n_expert_used             # sink slots live inside the capacity
    assert capi["pool"] == [200_000 // expert_bytes - n_sink, expert_bytes]
    assert sum(capi["proj_bytes"]) == expert_bytes and capi["proj_bytes"][3] == 0
    # slots plus each layer's three id planes for max_tokens=16 (I32), with alignment padding
    assert capi["allocated"] >= (capi["pool"][0] + n_sink) * expert_bytes + 4 * 3 * n_sink * 16 * 4
    assert capi["zero_slots"] == 0 and capi["zero_allocated"] == 0


def test_slot_load_copies_the_file_bytes(capi, q8_model):
    index = ExpertIndex.open(q8_model)
    down = next(r for r in index.ranges(1, 5) if "ffn_down_exps" in r.tensor)
    with open(q8_model, "rb") as f:
        f.seek(down.offset)
        expected = f.read(down.length)
    assert bytes.fromhex(capi["slot_down_l1_e5"]) == expected
    assert capi["roundtrip"] is True


def test_tables_and_errors(capi):
    assert capi["unknown_device"] == 2 and capi["null_model"] == 1 and capi["zero_tokens"] == 1
    assert capi["table_0_3"] == 0 and capi["table_0_4"] == -1 and capi["table_1_4"] == 0
    errors = capi["errors"]
    assert set(errors) == {"slot_set_wrong_size", "slot_out_of_range", "expert_out_of_range",
                           "table_bad_slot", "layer_out_of_range", "slot_taken",
                           "route_bad_expert", "route_bad_layer"}
    assert all(msg.endswith("bad argument") for msg in errors.values()), errors
