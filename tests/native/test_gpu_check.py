"""scripts/gpu_check.sh is ready for the GPU machine as far as a CPU can tell: its dry run
takes every step (offline wheels, the build from the pruned archive, which is the install's
own and so compiles nothing, model, benchmark) on the CPU, and its Vulkan dry run the GPU steps
on lavapipe."""
from __future__ import annotations

import os
import re
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from tests.native.conftest import skip_without_vulkan_toolchain

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "gpu_check.sh"
OFFLINE = REPO / "offline"


def test_offline_payload_is_small_and_complete():
    total = sum(f.stat().st_size for f in OFFLINE.rglob("*") if f.is_file())
    print(f"offline: {total / 2**20:.1f} MiB")
    assert total < 40 * 2**20
    with tarfile.open(OFFLINE / "llama-cpp-python-0.3.36-pruned.tar.xz") as tar:
        names = set(tar.getnames())
    root = "llama_cpp_python-0.3.36/"
    for needed in ("vendor/llama.cpp/src/llama-graph.cpp", "vendor/llama.cpp/ggml/src/ggml-cuda/mmq.cu",
                   "vendor/llama.cpp/ggml/src/ggml-cpu/ops.cpp", "llama_cpp/llama_cpp.py"):
        assert root + needed in names, needed
    wheels = {p.name.split("-")[0].lower() for p in (OFFLINE / "wheels").glob("*.whl")}
    assert {"numpy", "gguf", "cffi", "psutil", "tqdm", "jinja2", "diskcache"} <= wheels
    # the GPU machine's python3 is 3.12 (numpy, psutil, tqdm, jinja2 included): cffi for it
    assert any(p.name.startswith("cffi-") and "-cp312-" in p.name
               for p in (OFFLINE / "wheels").glob("*.whl"))


@pytest.mark.slow
def test_dry_run(native_build, tmp_path):
    # the bare interpreter under this venv: the script installs what it lacks from the wheels
    env = dict(os.environ, GPU_CHECK_WORK=str(tmp_path), GPU_CHECK_REPS="1",
               PYTHON=getattr(sys, "_base_executable", sys.executable))
    env.pop("LLAMA_CPP_LIB_PATH", None)
    proc = subprocess.run([str(SCRIPT), "--dry-run"], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    table = (tmp_path / "bench-dry-run.md").read_text()
    print(table)
    # the real Qwen3-30B-A3B routing trace, played: its 28-token prompt and 128 decode rows
    for row in ("| lru ", "| phase-specific ", "pp28@trace", "tg129@trace",
                "routing imposed from qwen3-30b-a3b.route.csv"):
        assert row in table
    assert "cpu-slots" in table and re.search(r"gpu_check \[\d+ s\]: libraries:", proc.stderr)
    # the install's build, found by its key (same archive, patches and flags): nothing compiles
    assert "native build cpu: compiling" not in proc.stderr, proc.stderr[-3000:]
    if native_build.backend == "cpu":
        assert f"libraries: {native_build.lib_dir}" in proc.stderr
    assert "installing from" in proc.stderr     # the wheels path ran (the bare interpreter)
    check_rows = [ln for ln in table.splitlines() if ln.startswith("| lru | cpu-slots")
                  or ln.startswith("| phase-specific | cpu-slots")]
    assert len(check_rows) == 2 and all(ln.rstrip().endswith("| yes |") for ln in check_rows)
    # the per-layer overhead of the cache machinery, next to the speed table
    overhead = [ln for ln in table.splitlines() if ln.startswith("| cache ")]
    assert "+ µs per MoE layer" in table and len(overhead) == 2


@pytest.mark.slow
def test_vulkan_dry_run(native_build, tmp_path):
    """The GPU run's steps on a real device: the Vulkan build on lavapipe, a vulkan:0 cache,
    and the static --n-cpu-moe rows (which need a GPU backend)."""
    skip_without_vulkan_toolchain()
    env = dict(os.environ, GPU_CHECK_WORK=str(tmp_path), GPU_CHECK_REPS="1")
    env.pop("LLAMA_CPP_LIB_PATH", None)
    proc = subprocess.run([str(SCRIPT), "--vulkan-dry-run"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stderr[-3000:]
    table = (tmp_path / "bench-vulkan-dry-run.md").read_text()
    print(table)
    for row in ("| n-cpu-moe=4 ", "| n-cpu-moe=3 ", "| lru ", "| phase-specific "):
        assert re.search(re.escape(row) + r"\s*\| Vulkan0\+CPU", table), row
    check_rows = [ln for ln in table.splitlines() if re.match(r"\| (lru|phase-specific) \| vulkan:0", ln)]
    assert len(check_rows) == 2 and all(ln.rstrip().endswith("| yes |") for ln in check_rows)


def test_bad_argument():
    proc = subprocess.run([str(SCRIPT), "--bogus"], capture_output=True, text=True)
    assert proc.returncode == 2 and "usage" in proc.stderr
