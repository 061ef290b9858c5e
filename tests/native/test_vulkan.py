"""The device cache on a real non-host device: the Vulkan build on lavapipe (Mesa's Vulkan
driver on the CPU). The model loads as the engine loads it for a GPU cache (every layer on the
device, the routed experts in a host buffer), the slots live in device memory, and the graph
takes the GPU paths: the prompt's expert matmuls are offloaded by the scheduler (which copies
the experts the cold ids name), decode runs the cold path on the CPU and the hot path on the
device. Needs scripts/vulkan_toolchain.sh (CI runs it); skipped where it could not run.
Flash attention stays off: lavapipe 22.3 crashes in that shader once the KV cache passes 32
cells, with or without the cache."""
from __future__ import annotations

import re

import numpy as np
import pytest

from tests.native.conftest import run_child, skip_without_vulkan_toolchain
from tests.native.test_parity import PROMPT, _capacity

GREEDY = 12
TEXT = "the quick brown fox jumps over the lazy dog and then"


@pytest.fixture(scope="module")
def vulkan_build():
    """The Vulkan build `moe-offload native build --backend vulkan` (and the Vulkan dry run of
    scripts/gpu_check.sh) makes: the install's request with the backend switched, so the
    three share one key and one compile."""
    import dataclasses

    from runtime.native.install import request_from_cmake_args

    from tests.conftest import build_with_progress

    skip_without_vulkan_toolchain()
    req = dataclasses.replace(request_from_cmake_args(), backend="vulkan")
    return build_with_progress(req, "tests/native/test_vulkan.py")


@pytest.fixture(scope="module", autouse=True)
def lavapipe():
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("GGML_VK_VISIBLE_DEVICES", "0")           # ggml skips CPU-type devices
        yield


def _run(model, lib_dir, tmp_path, name, **extra):
    args = {"model": str(model), "prompt_tokens": PROMPT, "greedy": GREEDY, "n_expert": 16,
            "ngl": 99, "experts_on_cpu": True, "flash_attn": False, "capacity": None,
            "fill": "all", "out": str(tmp_path / f"{name}.npy"), **extra}
    res = run_child("logits", args, lib_dir)
    return np.load(res["logits_npy"]), res


@pytest.fixture(scope="module")
def reference(lavapipe, vulkan_build, q8_model, tmp_path_factory):
    """Everything but the routed experts on the device, no cache."""
    return _run(q8_model, vulkan_build.lib_dir, tmp_path_factory.mktemp("vk"), "ref")


@pytest.mark.parametrize("fraction, fill", [(0.0, "all"), (0.5, "even"), (1.0, "all")])
def test_device_slots_match_unpatched(vulkan_build, q8_model, reference, tmp_path, fraction,
                                      fill):
    ref_logits, ref = reference
    logits, res = _run(q8_model, vulkan_build.lib_dir, tmp_path, "hot", device="Vulkan0",
                       capacity=_capacity(q8_model, fraction), fill=fill)
    assert "error" not in res, res.get("error")
    diff = float(np.abs(logits - ref_logits).max())
    print(f"Vulkan0 slots, {fraction:.0%} of experts ({res['resident']} resident): max abs "
          f"logit diff {diff:.3g}")
    assert (res["resident"] > 0) == (fraction > 0)
    assert diff <= 1e-4 and res["greedy"] == ref["greedy"]


@pytest.mark.parametrize("ngl", [0, 2])
@pytest.mark.parametrize("fraction, fill", [(0.5, "even"), (1.0, "all")])
def test_device_slots_match_unpatched_with_the_routers_on_the_cpu(
        vulkan_build, lavapipe, q8_model, tmp_path, ngl, fraction, fill):
    """Fewer layers on the device than the model has (-ngl 0, the default, or 2 of 4): those
    layers' routers run on the CPU, and the host writes their id planes there, in the CPU's
    split; the device's hot path and the CPU's cold path both read the planes' copy made on the
    device after the write (the same tokens and logits as the unpatched graph at that -ngl)."""
    ref_logits, ref = _run(q8_model, vulkan_build.lib_dir, tmp_path, f"ref{ngl}", ngl=ngl)
    logits, res = _run(q8_model, vulkan_build.lib_dir, tmp_path, f"hot{ngl}", ngl=ngl,
                       device="Vulkan0", capacity=_capacity(q8_model, fraction), fill=fill)
    assert "error" not in res, res.get("error")
    diff = float(np.abs(logits - ref_logits).max())
    print(f"-ngl {ngl}, Vulkan0 slots, {fraction:.0%} of experts ({res['resident']} "
          f"resident): max abs logit diff {diff:.3g}")
    assert res["resident"] > 0
    assert diff <= 1e-4 and res["greedy"] == ref["greedy"]


def test_device_slots_are_really_used(vulkan_build, q8_model, reference, tmp_path):
    ref_logits, _ = reference
    logits, _ = _run(q8_model, vulkan_build.lib_dir, tmp_path, "shifted", device="Vulkan0",
                     capacity=_capacity(q8_model, 1.0), fill="shifted")
    assert float(np.abs(logits - ref_logits).max()) > 1e-2


def test_the_scheduler_runs_the_gpu_paths(vulkan_build, q8_model, tmp_path, monkeypatch):
    """Read from the scheduler's own assignment (GGML_SCHED_DEBUG=2): the hot matmuls run on
    the device over the slots; the prompt's cold matmuls run on the device over the scheduler's
    copy of the host experts, indexed by the cold ids (so only the experts those name are
    copied); decode's cold matmuls run on the CPU."""
    monkeypatch.setenv("GGML_SCHED_DEBUG", "2")
    _, res = _run(q8_model, vulkan_build.lib_dir, tmp_path, "sched", device="Vulkan0",
                  capacity=_capacity(q8_model, 0.5), fill="even", greedy=1)
    # one dump per scheduled graph; those built before the cache was registered have no hot path
    graphs = [g for g in res["stderr"].split("## SPLIT #0:") if "_hot-" in g]
    assert len(graphs) >= 2                                  # the prompt and a decode step
    nodes = [ln for g in graphs for ln in g.splitlines() if "(MUL_MAT_ID)" in ln]
    hot = [ln for ln in nodes if re.search(r"ffn_moe_\w+_hot-\d+ ", ln)]
    cold = [ln for ln in nodes if re.search(r"ffn_moe_(gate|up|down)-\d+ ", ln)]
    assert hot and all("[Vulka" in ln.split("use=")[0] for ln in hot)
    offloaded = [ln for ln in cold if "Vulkan0#blk." in ln]
    assert offloaded and all("ffn_moe_cold_ids" in ln for ln in offloaded)
    on_cpu = [ln for ln in cold if "[  CPU" in ln.split("use=")[0] and "ffn_moe_cold_ids" in ln]
    assert on_cpu                                            # decode: repeats on the CPU
    # the CPU cannot read device memory in place: every reader reads the planes' copy, made on
    # the device after the host wrote them
    copies = [ln for g in graphs for ln in g.splitlines() if re.search(r"\(\s*CONT\)", ln)
              and "ffn_moe_planes_copy" in ln.split("use=")[0]]
    assert copies and all("[Vulka" in ln.split("use=")[0] for ln in copies)


def _engine(model, lib_dir, budget, policy="lru", ngl=99, max_tokens=40):
    return run_child("engine", {"model": str(model), "lib_dir": lib_dir, "device": "vulkan:0",
                                "slots": budget, "policy": policy, "prompt": TEXT,
                                "max_tokens": max_tokens, "n_gpu_layers": ngl}, lib_dir)


@pytest.fixture(scope="module")
def engine_reference(lavapipe, vulkan_build, q8_model):
    """The engine's placement for a vulkan:0 cache (layers on the device, experts in host
    memory) with a budget too small for any slot next to the sinks: no cache, same graph."""
    res = _engine(q8_model, vulkan_build.lib_dir, "60KB")
    assert "holds no expert slot" in res["stderr"] and "copies" not in res
    return res


@pytest.mark.parametrize("budget, policy", [("300KB", "lru"), ("600KB", "lfu"), ("2MB", "lru")])
def test_engine_with_a_vulkan_cache(vulkan_build, q8_model, engine_reference, budget, policy):
    """Engine -> routing hook -> manager -> copy threads -> slots in device memory -> graph:
    greedy tokens equal the same placement without the cache, with evictions mid-generation."""
    res = _engine(q8_model, vulkan_build.lib_dir, budget, policy)
    snap = res["snapshot"]["devices"]["vulkan:0"]
    decode, prefill = snap["phases"]["decode"], snap["phases"]["prefill"]
    print(f"vulkan:0 {budget} {policy}: {res['slots']} slots, {res['copies']} copies, "
          f"prefill hits {prefill['hits']}/{prefill['accesses']}, decode hits "
          f"{decode['hits']}/{decode['accesses']}")
    assert res["tokens"] == engine_reference["tokens"]
    assert res["copies"] > 0 and res["failures"] == 0
    assert res["resident"] == snap["resident_experts"]
    if res["slots"] < 64:
        assert decode["evictions"] > 0


def test_engine_with_a_vulkan_cache_at_the_default_ngl(vulkan_build, lavapipe, q8_model):
    """-ngl 0 (the CLI's default): every layer, its router included, runs on the CPU and only
    the hot experts on the device; greedy tokens equal the same placement without the cache,
    with evictions mid-generation. 20 tokens: lavapipe's q8_0 kernels round differently from
    ggml-cpu's (decode logits 0.03-0.07 apart with the same tokens fed, measured), so a long
    greedy run on random weights meets a near-tie where the two devices pick differently (at
    token 24 here; -ngl 99's runs too, from token 23 to 37 by cache size)."""
    ref = _engine(q8_model, vulkan_build.lib_dir, "60KB", ngl=0, max_tokens=20)
    assert "holds no expert slot" in ref["stderr"]
    res = _engine(q8_model, vulkan_build.lib_dir, "1MB", ngl=0, max_tokens=20)
    assert "device cache off" not in res["stderr"]
    decode = res["snapshot"]["devices"]["vulkan:0"]["phases"]["decode"]
    print(f"-ngl 0, vulkan:0 1MB: {res['slots']} slots, {res['copies']} copies, decode hits "
          f"{decode['hits']}/{decode['accesses']}, evictions {decode['evictions']}")
    assert res["tokens"] == ref["tokens"]
    assert res["copies"] > 0 and res["failures"] == 0 and decode["hits"] > 0
    assert decode["evictions"] > 0


def _buffers(model, lib_dir, placement, **extra):
    return run_child("placement", {"model": str(model), "placement": placement,
                                   "n_gpu_layers": 99, "lib_dir": lib_dir, **extra},
                     lib_dir)["buffers"]


def test_static_n_cpu_moe_placement(vulkan_build, lavapipe, q8_model):
    """The benchmark's --n-cpu-moe N baseline: layers 0..N-1 keep their experts in host
    memory, the rest go to the device with the dense layers."""
    buffers = _buffers(q8_model, vulkan_build.lib_dir, "cpu-moe:2")
    assert [b.startswith("CPU") for b in buffers] == [True, True, False, False], buffers
    assert buffers[2:] == ["Vulkan0", "Vulkan0"]
    assert all(b == "Vulkan0" for b in _buffers(q8_model, vulkan_build.lib_dir, "cpu-moe:0"))


def test_cache_placement_keeps_experts_mapped(vulkan_build, lavapipe, q8_model):
    """With a device cache every expert stays in the file mapping, not repacked: the cold
    path's repeated ids need llama.cpp's plain CPU buffers."""
    buffers = _buffers(q8_model, vulkan_build.lib_dir, "planned", device="vulkan:0",
                       slots="300KB")
    assert buffers == ["CPU_Mapped"] * 4, buffers
