"""The C library (residency core, routing hook, slot cache) builds with the system compiler on
first use, into the cache; without a working compiler every command says so in one line."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]


def _replay(tmp_path, **env):
    full = dict(os.environ, MOE_OFFLOAD_CACHE=str(tmp_path / "cache"), **env)
    return subprocess.run([sys.executable, "-m", "runtime.cli", "replay",
                           str(REPO / "tests/runtime/traces/data/gpt-oss-120b.route.csv"),
                           "--capacity", "20%", "--policy", "lru", "--json"],
                          cwd=REPO, env=full, capture_output=True, text=True, timeout=300)


def test_builds_into_an_empty_cache(tmp_path):
    proc = _replay(tmp_path)
    assert proc.returncode == 0, proc.stderr
    built = list((tmp_path / "cache" / "residency").glob("moe_offload_native-*.so"))
    assert len(built) == 1


def test_no_compiler_is_one_line(tmp_path):
    proc = _replay(tmp_path, CC=str(tmp_path / "no-such-cc"))
    assert proc.returncode == 2
    assert proc.stderr.startswith("moe-offload: error: the residency core could not be "
                                  "compiled"), proc.stderr
    assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
