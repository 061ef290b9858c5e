"""The whole path: Engine -> routing hook -> residency manager -> DeviceCache (Transport) ->
slots -> patched graph. Greedy tokens equal residency off, with evictions mid-generation."""
from __future__ import annotations

import pytest

from runtime.native.pools import ggml_device_name
from tests.native.conftest import run_child

PROMPT = "the quick brown fox jumps over the lazy dog and then"


@pytest.fixture(scope="module")
def plain(native_build, q8_model):
    """Residency off, in the placement a device cache loads with: no extra CPU buffer types
    (AMX or repacked weights compute with other kernels, which round differently)."""
    return run_child("engine", {"model": str(q8_model), "lib_dir": native_build.lib_dir,
                                "slots": None, "prompt": PROMPT, "max_tokens": 24,
                                "repack": False}, native_build.lib_dir)


@pytest.mark.parametrize("budget, policy", [("160KB", "lru"), ("300KB", "lru"),
                                            ("300KB", "lfu"), ("2MB", "lru")])
def test_greedy_tokens_identical_with_slots(native_build, q8_model, plain, budget, policy):
    res = run_child("engine", {"model": str(q8_model), "lib_dir": native_build.lib_dir,
                               "slots": budget, "policy": policy, "prompt": PROMPT,
                               "max_tokens": 24}, native_build.lib_dir)
    snap = res["snapshot"]["devices"]["cpu-slots"]
    decode = snap["phases"]["decode"]
    prefill = snap["phases"]["prefill"]
    print(f"cpu-slots {budget} {policy}: {res['slots']} slots, {res['copies']} copies, "
          f"prefill hits {prefill['hits']}/{prefill['accesses']}, decode hits "
          f"{decode['hits']}/{decode['accesses']}, evictions "
          f"{prefill['evictions'] + decode['evictions']}")
    assert res["tokens"] == plain["tokens"]
    assert res["copies"] > 0 and res["failures"] == 0
    assert res["resident"] == snap["resident_experts"]   # the tables agree with the manager
    if res["slots"] < 64:                                 # smaller than the expert bank
        assert decode["evictions"] > 0                    # evicted mid-generation


def test_device_names():
    assert ggml_device_name("cpu-slots") == "CPU"
    assert ggml_device_name("cuda:1") == "CUDA1"
    assert ggml_device_name("vulkan:0") == "Vulkan0"
    with pytest.raises(ValueError):
        ggml_device_name("cpu")


def test_engine_picks_the_patched_build_by_itself(native_build, q8_model, plain):
    """No lib_dir and no LLAMA_CPP_LIB_PATH: the engine loads this install's build by
    itself, so the cache really copies experts, and tokens stay identical."""
    res = run_child("engine", {"model": str(q8_model), "lib_dir": None, "slots": "300KB",
                               "prompt": PROMPT, "max_tokens": 24}, None)
    assert res["tokens"] == plain["tokens"]
    assert res.get("copies", 0) > 0, res["stderr"][-2000:]
    assert "needs the patched llama.cpp" not in res["stderr"]


@pytest.mark.parametrize("capacity, policy", [("160KB", "lru"), ("400KB", "lfu-decay"),
                                              ("400KB", "phase-weighted"), ("1MB", "lfu")])
def test_tables_follow_the_manager_under_churn(native_build, q8_model, capacity, policy):
    """Random skewed routing, prefill and decode, thousands of copies on 4 threads: at every
    checkpoint the slot tables equal the manager's residency and every resident slot holds
    exactly its expert's bytes from the file."""
    res = run_child("churn", {"model": str(q8_model), "capacity": capacity, "policy": policy,
                              "steps": 200, "seed": 3}, native_build.lib_dir)
    print(f"churn {capacity} {policy}: "
          f"{ {k: v for k, v in res.items() if k != 'stderr'} }")
    assert res["checks"] == 8 * 4 * 16
    assert res["mismatches"] == 0 and res["failures"] == 0 and res["refused"] == 0
    assert res["copies"] > res["slots"] and res["evictions"] > 0


def test_failed_copies_leave_tables_and_manager_in_agreement(native_build, q8_model):
    """Every 7th copy fails: its expert leaves the manager (its victims stay evicted), so at
    every checkpoint the tables still equal the manager's residency, and the slots their
    experts' bytes."""
    res = run_child("churn", {"model": str(q8_model), "capacity": "400KB", "policy": "lru",
                              "steps": 200, "seed": 5, "fail_every": 7}, native_build.lib_dir)
    print(f"churn with failures: { {k: v for k, v in res.items() if k != 'stderr'} }")
    assert res["failures"] > 10 and res["copies"] > res["failures"]
    assert res["mismatches"] == 0 and res["checks"] == 8 * 4 * 16
    assert res["resident"] == res["resident_experts"]
