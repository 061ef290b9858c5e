"""The registry drives the policy tests: a policy added as its three parts (its C file, its
reference class, its registry line; core/core_impl.h) in a copy of the tree is picked up by
the suite's policy tests with no test edit: its name in the listed names and the generated
table, the C core's kinds, and the C core compared against its reference at its defaults."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from runtime.native.source import cache_root as native_cache_root

REPO = Path(__file__).resolve().parents[3]

# a throwaway eviction policy: the most recently used key goes first
C_FILE = '''/* eviction newest-first (a test's throwaway policy): the most recent use goes first */
#include "../core_impl.h"

static double score(const rc_core *c, int32_t o, int32_t f) {
    (void) o;
    return -(double) c->last_seq[f];
}

RC_EVICTION_POLICY(newest_first, "newest-first", .ops = &rc_heap_order, .score = score);
'''
REFERENCE = '''

class NewestFirst(EvictionPolicy):
    @staticmethod
    def priority(stats, params, state, f):
        return -float(stats.last[f])
'''
REGISTRY_AFTER = '        "lfu": Policy({}, eviction.Lfu),\n'
REGISTRY_LINE = '        "newest-first": Policy({}, eviction.NewestFirst),\n'

# the suite's tests that list, table or compare policies (run in the copy)
POLICY_TESTS = [
    "tests/runtime/residency/test_policies.py::test_factory_lists_valid_names",
    "tests/runtime/residency/test_config.py::test_parse_errors",
    "tests/runtime/residency/test_policy_table.py",
    "tests/runtime/residency/test_core_build.py::test_registry_names_are_the_cores",
    "tests/runtime/residency/test_core_reference.py::test_each_policy_equals_reference",
    "tests/runtime/residency/test_manager.py::test_same_sequence_same_decisions",
]


def _copy_with_policy(root: Path) -> None:
    for part in ("runtime", "gguf_tools", "tests", "llamacpp"):   # (the patches the
        shutil.copytree(REPO / part, root / part,                # llama.cpp build is found by)
                        ignore=shutil.ignore_patterns("__pycache__", "offline"))
    shutil.copy(REPO / "pyproject.toml", root)
    core = root / "runtime/residency/core"
    (core / "policies/evict_newest_first.c").write_text(C_FILE)
    policies = root / "runtime/residency/policies"
    with (policies / "eviction.py").open("a") as f:
        f.write(REFERENCE)
    factory = policies / "factory.py"
    text = factory.read_text()
    assert text.count(REGISTRY_AFTER) == 1
    factory.write_text(text.replace(REGISTRY_AFTER, REGISTRY_AFTER + REGISTRY_LINE))


def test_a_new_policy_is_picked_up_by_the_policy_tests(tmp_path):
    root = tmp_path / "tree"
    _copy_with_policy(root)
    # the copy's own C library in a cache of its own; the one llama.cpp build where it is
    # (the suite's session start looks for it: the copy's patches are the same)
    env = dict(os.environ, PYTHONPATH=str(root), MOE_OFFLOAD_CACHE=str(tmp_path / "cache"),
               MOE_OFFLOAD_NATIVE_DIR=str(native_cache_root()))
    proc = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-v",
                           "-x", *POLICY_TESTS, "-k", "newest or not equals_reference and "
                           "not same_sequence"],
                          cwd=root, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    out = proc.stdout
    assert f"rootdir: {root}" in out                       # the copy's tests ran
    for test in ("test_each_policy_equals_reference[eviction-newest-first] PASSED",
                 "test_same_sequence_same_decisions[newest-first] PASSED",
                 "test_registry_names_are_the_cores PASSED",
                 "test_factory_lists_valid_names[eviction] PASSED"):
        assert test in out, out[-3000:]
