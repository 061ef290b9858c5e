"""ExpertLayout against byte-by-byte reference computations."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from runtime.ramtier.layout import ExpertLayout
from runtime.ramtier.vm import PAGE_SIZE as PS


@st.composite
def layouts(draw):
    n_keys = draw(st.integers(1, 6))
    pos, table = draw(st.integers(0, 3 * PS)), {}
    for _ in range(draw(st.integers(1, 12))):
        key = draw(st.integers(0, n_keys - 1))
        length = draw(st.integers(1, 3 * PS))
        table.setdefault(key, []).append((pos, length))
        pos += length + draw(st.sampled_from([0, 0, 0, 32, PS]))   # gaps hold "dense" bytes
    file_bytes = pos + draw(st.integers(0, PS))
    resident = {k: draw(st.booleans()) for k in table}
    pages = np.array(draw(st.lists(st.booleans(), min_size=-(-file_bytes // PS),
                                   max_size=-(-file_bytes // PS))), dtype=bool)
    return table, file_bytes, resident, pages


def _owners(table, file_bytes):
    owner = np.full(file_bytes, -1)
    for k, spans in table.items():
        for o, n in spans:
            owner[o:o + n] = k
    return owner


@settings(max_examples=200, deadline=None)
@given(layouts())
def test_resident_bytes_matches_byte_count(case):
    table, file_bytes, _, pages = case
    layout = ExpertLayout(table)
    owner = _owners(table, file_bytes)
    byte_resident = np.repeat(pages, PS)[:file_bytes]
    got = layout.resident_bytes(pages)
    for k in table:
        assert got[layout.key_index(k)] == int(np.sum((owner == k) & byte_resident))


@settings(max_examples=200, deadline=None)
@given(layouts())
def test_droppable_pages_hold_only_leaving_bytes(case):
    table, file_bytes, resident, _ = case
    layout = ExpertLayout(table)
    owner = _owners(table, file_bytes)
    padded = np.concatenate([owner, np.full(-(-file_bytes // PS) * PS - file_bytes, -1)])
    for key in table:
        got = {o // PS + i for o, n in layout.droppable(key, lambda k: resident[k])
               for i in range(n // PS)}
        want = set()
        for o, n in table[key]:
            for page in range(o // PS, (o + n - 1) // PS + 1):
                held = padded[page * PS:(page + 1) * PS]
                if np.all(held >= 0) and all(h == key or not resident[h] for h in set(held.tolist())):
                    want.add(page)
        assert got == want


def test_overlapping_ranges_are_rejected():
    with pytest.raises(ValueError, match="overlap"):
        ExpertLayout({0: [(0, 100)], 1: [(50, 100)]})
