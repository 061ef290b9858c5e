"""Bounded memory from the first byte: with a ``cpu`` budget, the experts' bytes in RAM (page
cache, as mincore sees it, and no anonymous copy) stay within the budget plus docs/ramtier.md's bound
at every moment from process start to exit, load included, for a model larger than the cgroup
memory limit it runs under. Sampled from outside every <= 50 ms (runtime/bench/memwatch.py).

The bound needs the lazy load of our patched llama.cpp (llamacpp/patches/0006: the routed experts
load lazily, so llama.cpp's mmap neither prefetches the whole file nor repacks them), which the
engine asks for only with a RAM tier; plain llama.cpp placement (``--no-residency``: llama.cpp's
default load, which populates the mapping) through the same library is shown breaking the
same bound, so the check can fail."""
from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time

import pytest

from gguf_tools.facts import read_model_facts
from gguf_tools.synth import SynthSpec
from runtime.bench.memwatch import MemoryWatch
from runtime.ramtier.cgroup import MemoryLimit
from runtime.ramtier.pager import drop_file_cache

MiB = 1 << 20
# 16 layers x 32 experts x 816 KiB (q8_0) = 408 MiB of experts: larger than the limit below
SPEC = SynthSpec(arch="qwen3moe", layers=16, experts=32, top_k=4, embd=512, ff=512,
                 dtype="q8_0", seed=3, skew=1.0)
LIMIT = 320 * MiB
BUDGET = 48 * MiB
INFLIGHT = 16 * MiB          # docs/ramtier.md: reads in flight (the background refill's at most)
INTERVAL = 0.02              # seconds between samples (the bound asks for <= 50 ms)


def _run(model, config, *, limit: int | None):
    """``complete`` under ``limit`` (None: none) with the RAM tier of ``config``, or with
    residency off (``config`` None: llama.cpp's own placement), watched from outside."""
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE"}
    placement = ["--config", str(config)] if config is not None else ["--no-residency"]
    cmd = [sys.executable, "-m", "runtime.cli", "complete", "-m", str(model), *placement,
           "-p", "Once upon a time, in a land far away,", "-n", "24", "-t", "1",
           "-c", "256", "--temp", "0"]
    drop_file_cache(str(model))
    group = MemoryLimit(limit) if limit else None
    with (group if group else contextlib.nullcontext()), MemoryWatch(
            model, interval=INTERVAL, cgroup_dir=group.path if group else None) as watch:
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, preexec_fn=group.join if group else None)
        watch.pid = proc.pid
        out, err = proc.communicate(timeout=300)
        time.sleep(2 * INTERVAL)
    return proc.returncode, out, err, watch


@pytest.mark.skipif(not MemoryLimit.supported(), reason="no cgroup v1 memory controller here")
def test_experts_in_ram_stay_within_the_budget_from_the_first_byte(synth_model_factory,
                                                                   tmp_path):
    model = synth_model_factory(SPEC)
    facts = read_model_facts(model)
    assert facts.file_bytes > LIMIT
    config = tmp_path / "cpu.toml"
    config.write_text(f'[devices]\ncpu = "{BUDGET // MiB}MiB"\n')
    layer = max(facts.expert_bytes) * facts.n_expert      # a prompt may touch a whole layer
    bound = BUDGET + layer + INFLIGHT

    rc, out, err, watch = _run(model, config, limit=LIMIT)
    assert rc == 0, f"rc {rc}: {err[-2000:]}"
    assert "expert hit rate" in err
    duration = watch.samples[-1].t
    gaps = sorted(b.t - a.t for a, b in zip(watch.samples, watch.samples[1:]))
    assert len(watch.samples) >= duration / 0.05, (len(watch.samples), duration)
    assert gaps[int(0.95 * len(gaps))] <= 0.05, gaps[-5:]
    peak = watch.peak("expert_cache_bytes")
    print(f"\nbounded: {len(watch.samples)} samples over {duration:.1f} s (median gap "
          f"{gaps[len(gaps) // 2] * 1e3:.0f} ms, max {gaps[-1] * 1e3:.0f} ms); experts in the "
          f"page cache peak {peak / MiB:.1f} MiB <= {bound / MiB:.1f} MiB (budget "
          f"{BUDGET / MiB:.0f} + layer {layer / MiB:.1f} + in flight {INFLIGHT / MiB:.0f}); "
          f"anonymous RSS peak {watch.peak('rss_anon_bytes') / MiB:.1f} MiB; cgroup peak "
          f"{watch.peak('cgroup_bytes') / MiB:.1f} MiB of {LIMIT / MiB:.0f}")
    assert peak <= bound
    # no anonymous copy of the experts (llama.cpp's repacking would be the whole 408 MiB)
    assert watch.peak("rss_anon_bytes") < facts.total_expert_bytes // 2

    # llama.cpp's placement through the same library, no limit: its load populates the mapping
    rc, out, err, plain = _run(model, None, limit=None)
    assert rc == 0, err[-2000:]
    print(f"llama.cpp's placement (--no-residency): experts in the page cache peak "
          f"{plain.peak('expert_cache_bytes') / MiB:.1f} MiB")
    assert plain.peak("expert_cache_bytes") > bound
