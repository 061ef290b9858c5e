"""The C library (residency core, routing hook, device cache) builds with the system compiler on
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
    built = list((tmp_path / "cache" / "clib").glob("libmoe_offload-*.so"))
    assert len(built) == 1


def test_no_compiler_is_one_line(tmp_path):
    proc = _replay(tmp_path, CC=str(tmp_path / "no-such-cc"))
    assert proc.returncode == 2
    assert proc.stderr.startswith("moe-offload: error: moe-offload's C library could not be "
                                  "compiled"), proc.stderr
    assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1


def test_header_usage_example_compiles_and_runs(tmp_path):
    """residency_core.h's usage example, as written, is a C function body that builds
    against the library and runs to its own check."""
    import re
    import shutil

    import pytest

    from runtime.clib import library_path, load_library

    core_h = REPO / "runtime/residency/core/residency_core.h"
    header = core_h.read_text()
    block = header.split(" * Usage", 1)[1].split(" */", 1)[0]
    body = "\n".join(ln[7:] for ln in block.splitlines() if ln.startswith(" *     "))
    assert "rc_access" in body and "rc_pool_snapshot" in body
    cc = shutil.which(os.environ.get("CC", "") or "cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler")
    load_library()                                 # the library, built if it was not
    src = tmp_path / "example.c"
    src.write_text(f'#include "{core_h}"\n#include <stddef.h>\n'
                   f"int main(void) {{\n{body}\n}}\n")
    lib = library_path()
    exe = tmp_path / "example"
    done = subprocess.run([cc, "-Wall", "-Werror", "-o", str(exe), str(src), str(lib),
                           f"-Wl,-rpath,{lib.parent}", "-lm", "-lpthread"],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert re.search(r"rc_free\(c\);", body)
    assert subprocess.run([str(exe)]).returncode == 0


def test_registry_kinds_are_the_cores():
    """The one registry (policies/factory.py) names each policy's C kind: the core's enums
    (core/core_impl.h) agree, row for row."""
    import re

    from runtime.residency.policies.factory import c_kinds

    impl = (REPO / "runtime/residency/core/core_impl.h").read_text()
    for role, prefix in (("eviction", "EV_"), ("admission", "AD_"), ("prefetch", "PF_")):
        enum = re.search(r"enum \{ (%s[A-Z_, ]+) \};" % prefix, impl).group(1)
        names = [n.strip() for n in enum.split(",")]
        assert names[-1] == f"{prefix}N_KINDS"
        assert sorted(c_kinds(role).values()) == list(range(len(names) - 1)), role
