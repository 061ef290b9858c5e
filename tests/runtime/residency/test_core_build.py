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


def test_registry_names_are_the_cores():
    """The one registry (policies/factory.py) and the C core's generated tables (one file per
    policy in core/policies/) name the same policies, role by role; a kind is looked up by
    name, an unknown name is -1 (CCore: one clear line)."""
    import pytest

    from runtime.errors import UserError
    from runtime.clib import load_library
    from runtime.residency.core.c_core import c_policy_kind, c_policy_names
    from runtime.residency.policies.factory import ROLES, policy_names

    lib, ffi = load_library()
    for role in ROLES:
        names = c_policy_names(lib, ffi, role)
        assert sorted(names) == sorted(policy_names(role)), role
        assert [c_policy_kind(lib, ffi, role, n) for n in names] == list(range(len(names)))
    assert lib.rc_policy_kind(lib.RC_ROLE_EVICTION, b"no-such") == -1
    assert lib.rc_policy_name(lib.RC_ROLE_PREFETCH, -1) == ffi.NULL
    with pytest.raises(UserError, match="no eviction policy 'mru'"):
        c_policy_kind(lib, ffi, "eviction", "mru")


MRU = '''/* mru (a test's): evict the most recently accessed key */
#include "../core_impl.h"

static double score(const rc_core *c, int32_t o, int32_t f) {
    (void) o;
    return -(double) c->last_seq[f];
}

RC_EVICTION_POLICY(mru, "mru", .ops = &rc_heap_order, .score = score);
'''


def test_a_policy_is_one_file(tmp_path):
    """A copy of the core's part plus one new file in policies/ builds (the same build,
    runtime/clib.py) into a core that knows the policy by name and decides by it."""
    import shutil

    from runtime.clib import MANIFEST, Library, Part, open_library

    folders = ("csupport", "residency/core")   # the core and the support it includes, where
    for folder in folders:                     # the tree has them
        shutil.copytree(REPO / "runtime" / folder, tmp_path / folder,
                        ignore=shutil.ignore_patterns("__pycache__"))
    (tmp_path / "residency/core/policies/evict_mru.c").write_text(MRU)
    parts = tuple(Part.read(tmp_path / folder / MANIFEST) for folder in folders)
    lib, ffi = open_library(Library.of(parts))
    p = ffi.new("rc_policy *", {"n_orders": 1})
    p.order_kind[0] = lib.rc_policy_kind(lib.RC_ROLE_EVICTION, b"mru")
    assert p.order_kind[0] >= 0
    for ph in range(3):
        p.admission[ph] = lib.rc_policy_kind(lib.RC_ROLE_ADMISSION, b"always")
        p.prefetch[ph] = lib.rc_policy_kind(lib.RC_ROLE_PREFETCH, b"none")
    c = ffi.gc(lib.rc_create(1, 8, ffi.new("int64_t[]", [100]), p), lib.rc_free)
    assert lib.rc_set_pools(c, 1, ffi.new("int32_t[]", [0]), ffi.new("int64_t[]", [300])) == 0
    r = ffi.new("rc_result *")
    for expert in (0, 1, 2, 3):                   # three fit; the fourth evicts the newest
        assert lib.rc_access(c, 0, ffi.new("int32_t[]", [expert]), 1, lib.RC_DECODE, ffi.NULL,
                             -1, ffi.NULL, ffi.NULL, 0, 0, 0, r) == 0
    assert ffi.unpack(r.evicted, r.n_evicted) == [2]
    assert lib.rc_verify(c) == 0
