"""Replay = runtime, exactly: a trace recorded live with a device cache (``trace record
--config`` with a cpu-slots device, on a mixed-type model whose layers fall in two pools),
replayed with the recorded pools and the same policy, gives the live run's per-phase hits,
misses, admissions and evictions, for every eviction policy the runtime accepts (and the
affinity prefetch), at three cache sizes."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from gguf_tools.synth import SynthSpec
from tests.native.conftest import REPO

# q4_k_m: Q4_K gate/up and a down projection that alternates Q6_K / Q4_K by layer, as
# llama-quantize does: two expert layouts, so two pools in the cache
SPEC = SynthSpec(arch="qwen3moe", layers=4, experts=16, top_k=4, embd=256, ff=256,
                 dtype="q4_k_m", seed=3, skew=1.0)
COUNTERS = ("accesses", "hits", "misses", "admissions", "evictions", "transient_uses",
            "prefetch_issued")


def cli(*args: str, lib_dir: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, LLAMA_CPP_LIB_PATH=lib_dir,
               PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-m", "runtime.cli", *args], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc


@pytest.fixture(scope="module")
def q4km_model(synth_model_factory):
    return synth_model_factory(SPEC)


@pytest.mark.parametrize("share", [0.2, 0.45, 0.8])
@pytest.mark.parametrize("eviction,decode_prefetch", [
    ("lru", "none"), ("lfu", "none"), ("lfu-decay", "none"), ("phase-weighted", "none"),
    ("next-visit", "none"), ("next-visit", "affinity")])
def test_replay_of_a_live_trace_decides_alike(native_build, q4km_model, tmp_path, share,
                                              eviction, decode_prefetch):
    from gguf_tools.facts import read_model_facts

    facts = read_model_facts(q4km_model)
    budget = int(facts.total_expert_bytes * share)
    config = tmp_path / "c.toml"
    # an unlimited link without latency: replay times prefetches on the cost model (a late
    # one is a miss there, a hit live); affinity's budget per layer-step comes from [cost]
    config.write_text(f'[devices]\n"cpu-slots" = "{budget}B"\n'
                      f'[policy.prefill]\neviction = "{eviction}"\nprefetch = "chunk-plan"\n'
                      f'[policy.decode]\neviction = "{eviction}"\n'
                      f'prefetch = "{decode_prefetch}"\n[cost]\nlink_gbps = 1000000\n'
                      'link_latency_us = 0\n')
    trace, stats = tmp_path / "t.rtb", tmp_path / "live.json"
    cli("trace", "record", "-m", str(q4km_model), "-p", "the quick brown fox jumps over the "
        "lazy dog and then runs far away", "-n", "40", "--temp", "0", "--config", str(config),
        "-o", str(trace), "--stats-json", str(stats), lib_dir=native_build.lib_dir)
    live = json.loads(stats.read_text())["devices"]["cpu-slots"]
    assert len(live["pools"]) == 2                      # two layouts: two pools
    out = cli("replay", str(trace), "--capacity", "recorded", "--config", str(config),
              "--json", lib_dir=native_build.lib_dir)
    (cell,) = json.loads(out.stdout)
    want_decode = {k: live["phases"]["decode"][k] + live["phases"]["mixed"][k]
                   for k in COUNTERS}
    got_decode = {k: cell["decode"][k] for k in COUNTERS if k in cell["decode"]}
    want_prefill = {k: live["phases"]["prefill"][k] for k in COUNTERS}
    got_prefill = {k: cell["prefill"][k] for k in COUNTERS if k in cell["prefill"]}
    print(f"{eviction} {share:.0%}: live prefill {want_prefill}, decode {want_decode}")
    assert got_prefill == {k: want_prefill[k] for k in got_prefill}
    assert got_decode == {k: want_decode[k] for k in got_decode}
    assert set(got_decode) >= {"hits", "misses", "admissions", "evictions"}
    assert want_decode["misses"] > 0 and want_prefill["accesses"] > 0
    if share < 0.5:
        assert want_decode["evictions"] + want_prefill["evictions"] > 0


def test_config_check_shows_the_pools_the_cache_makes(native_build, q4km_model, tmp_path):
    """``config check -m`` reports the pools (layers, slots) the cache allocates at load: the
    same layers and capacities the live run's manager holds."""
    from gguf_tools.facts import read_model_facts

    budget = int(read_model_facts(q4km_model).total_expert_bytes * 0.45)
    config = tmp_path / "c.toml"
    config.write_text(f'[devices]\n"cpu-slots" = "{budget}B"\n')
    out = cli("config", "check", str(config), "-m", str(q4km_model),
              lib_dir=native_build.lib_dir).stdout
    stats = tmp_path / "live.json"
    cli("complete", "-m", str(q4km_model), "-p", "hello", "-n", "2", "--config", str(config),
        "--stats-json", str(stats), lib_dir=native_build.lib_dir)
    live = json.loads(stats.read_text())["devices"]["cpu-slots"]["pools"]
    lines = [ln.strip() for ln in out.splitlines() if ln.strip().startswith("pool ")]
    assert len(lines) == len(live) == 2, out
    for line, pool in zip(lines, live):
        assert f"= {pool['capacity_bytes']} bytes" in line, (line, pool)
        first, last = pool["layers"][0], pool["layers"][-1]
        assert f"layers {first}-{last}" in line or f"layers {first}" in line
