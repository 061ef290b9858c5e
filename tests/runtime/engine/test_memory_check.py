"""Before loading, a model that does not fit the memory cgroup is refused in one line with both
numbers (it was OOM-killed part way, status -9, no message), and one that fits still runs."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from gguf_tools.facts import read_model_facts
from gguf_tools.synth import SynthSpec
from runtime.engine.memory_check import SKIP_ENV, Room, check_fits, load_need
from runtime.engine.types import EngineSettings
from runtime.errors import UserError
from runtime.ramtier.cgroup import MemoryLimit, _limits

REPO = Path(__file__).resolve().parents[3]
# 4 KiB of KV cache per token: ctx 131072 is 512 MiB, ctx 32768 128 MiB; 14 MB of weights
BIG_KV = SynthSpec(arch="qwen3moe", layers=4, experts=8, top_k=2, embd=256, heads=8,
                   heads_kv=8, ff=64, dtype="f32", context_length=131072)
LIMIT = 300 << 20


@pytest.fixture(scope="module")
def big_kv_model(synth_model_factory) -> Path:
    return synth_model_factory(BIG_KV)


def _complete_in_group(model: Path, ctx: int, *, skip_check: bool = False):
    env = dict(os.environ, PYTHONPATH=str(REPO))
    env.pop(SKIP_ENV, None)
    if skip_check:
        env[SKIP_ENV] = "1"
    with MemoryLimit(LIMIT, name=f"moe-memcheck-{os.getpid()}") as group:
        return subprocess.run([sys.executable, "-m", "runtime.cli", "complete", "-m", str(model),
                               "-p", "hi", "-n", "2", "-c", str(ctx), "-t", "1"],
                              preexec_fn=group.join, capture_output=True, text=True, env=env,
                              timeout=300)


needs_cgroup = pytest.mark.skipif(not MemoryLimit.supported(),
                                  reason="no cgroup v1 memory controller to limit a child")


@needs_cgroup
def test_a_load_beyond_the_cgroup_limit_is_refused_in_one_line(big_kv_model):
    proc = _complete_in_group(big_kv_model, 131072)
    assert proc.returncode == 2, (proc.returncode, proc.stderr)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert "loading needs about 52" in lines[0] and "KV cache 512.00 MiB (ctx 131072)" in lines[0]
    assert "the memory cgroup's limit 300.00 MiB" in lines[0]


@needs_cgroup
def test_without_the_check_the_same_load_is_killed(big_kv_model):
    """What the check prevents: the kernel kills the load part way, with no message."""
    proc = _complete_in_group(big_kv_model, 131072, skip_check=True)
    assert proc.returncode == -9, (proc.returncode, proc.stderr)


@needs_cgroup
def test_a_load_that_fits_still_runs(big_kv_model):
    proc = _complete_in_group(big_kv_model, 32768)      # 128 MiB of KV in 300 MiB
    assert proc.returncode == 0, proc.stderr


def test_need_counts_dense_kv_compute_and_the_ram_tier(big_kv_model):
    facts = read_model_facts(str(big_kv_model))
    settings = EngineSettings(model_path=str(big_kv_model), n_ctx=1024, n_ubatch=256)
    need = load_need(settings, facts, on_gpu=False, ram_tier_bytes=1 << 40)
    assert need.kv_bytes == 4096 * 1024 and need.dense_bytes == facts.dense_bytes
    assert need.compute_bytes == 256 * 256 * 4 * 4
    assert need.ram_tier_bytes == facts.total_expert_bytes      # never more than every expert
    on_gpu = load_need(settings, facts, on_gpu=True, ram_tier_bytes=0)
    assert on_gpu.dense_bytes == 0 and on_gpu.ram_tier_bytes == 0
    # n_ctx 0: the model's training context
    assert load_need(EngineSettings(model_path=str(big_kv_model), n_ctx=0), facts,
                     on_gpu=False, ram_tier_bytes=0).n_ctx == 131072
    with pytest.raises(UserError, match=r"m.gguf: loading needs about .* more than the "
                                        r"1.00 MiB this process may use: test"):
        check_fits("m.gguf", need, Room(1 << 20, "test"))
    check_fits("m.gguf", need, Room(need.total, "test"))          # exactly fits
    check_fits("m.gguf", need, None)                               # nothing known


def test_cgroup_v2_limits_are_read_over_the_ancestors(tmp_path):
    """The v2 files (memory.max, memory.stat's anon) of a group and its parents: the
    smallest limit wins, "max" is none."""
    root = tmp_path / "cg"
    child = root / "a" / "b"
    child.mkdir(parents=True)
    (root / "memory.max").write_text("max\n")
    (root / "a" / "memory.max").write_text(f"{200 << 20}\n")
    (root / "a" / "memory.stat").write_text(f"anon {5 << 20}\nfile 123\n")
    (child / "memory.max").write_text("max\n")
    found = _limits(root, "/a/b", "memory.max", "anon")
    assert [(g.limit_bytes, g.anon_bytes) for g in found] == [(200 << 20, 5 << 20)]


def test_a_sliding_window_counts_half_the_layers_at_the_window(synth_model_factory):
    """gpt-oss alternates full and 128-token sliding-window layers: llama.cpp's KV cache for
    the window layers holds the window, so counting every layer at n_ctx would refuse loads
    that fit."""
    path = synth_model_factory(SynthSpec(arch="gpt-oss", layers=2, experts=4, top_k=2, embd=64,
                                         ff=32, heads=4, heads_kv=2))
    facts = read_model_facts(str(path))
    need = load_need(EngineSettings(model_path=str(path), n_ctx=4096), facts, on_gpu=False,
                     ram_tier_bytes=0)
    assert facts.sliding_window == 128
    assert need.kv_bytes == facts.kv_bytes_per_token * (4096 + 128) // 2
