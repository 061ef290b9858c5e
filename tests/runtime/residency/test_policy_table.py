"""The policy tables are generated from the policy files present (core/policy_table.py): one
registration a file, at its end, sorted by name per role; a malformed file is one clear
error naming it."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from runtime.residency.core import policy_table
from runtime.residency.core.policy_table import (ROLES, policy_files, registrations,
                                                 table_source)
from runtime.residency.policies.factory import policy_names

HERE = Path(policy_table.__file__).resolve().parent   # the core's source folder


def test_every_policy_file_registers_one_registry_policy():
    regs = registrations(policy_files(HERE))
    assert len(policy_files(HERE)) == sum(len(r) for r in regs.values())
    for role in ROLES:
        names = [name for name, _ in regs[role]]
        assert names == sorted(policy_names(role)), role


def test_the_table_is_sorted_and_deterministic():
    """Each role's registry names, sorted: a C kind is the name's index there."""
    files = policy_files(HERE)
    text = table_source(files)
    assert text == table_source(tuple(reversed(files)))
    for role in ROLES:
        for kind, name in enumerate(sorted(policy_names(role))):
            ident = name.replace("-", "_")
            assert f"&rc_{role}_{ident},  /* {kind}: {name} */" in text
    counts = ", ".join(str(len(policy_names(role))) for role in ROLES)
    assert f"RC_N_POLICIES[3] = {{{counts}}};" in text


@pytest.mark.parametrize("body, error", [
    ("static int x;\n", "ends with its one registration"),
    ('RC_EVICTION_POLICY(lru, "lru", .score = s);\nstatic int x;\n',
     "ends with its one registration"),
    ('RC_EVICTION_POLICY(most_recent, "mru", .score = s);\n', "registered as 'most_recent'"),
    ('RC_EVICTION_POLICY(lru, "lru", .score = s);\n', "eviction policy 'lru' registered twice"),
])
def test_a_malformed_policy_file_is_one_clear_error(tmp_path, body, error):
    shutil.copytree(HERE / "policies", tmp_path / "policies")
    (tmp_path / "policies" / "evict_zz.c").write_text(body)
    with pytest.raises(ValueError, match=error) as info:
        registrations(policy_files(tmp_path))
    assert "evict_zz.c" in str(info.value)
