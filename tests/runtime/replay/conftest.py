"""Fixtures for replay tests: the real traces (tests/runtime/traces/data) read once."""
from __future__ import annotations

from pathlib import Path

import pytest

from runtime.replay.harness import prepare
from runtime.traces.files import read_trace

DATA = Path(__file__).parents[1] / "traces" / "data"
REAL_TRACES = sorted(DATA.glob("*.route.csv"))
assert len(REAL_TRACES) == 2, f"expected the two real traces in {DATA}"

_PREPARED: dict[Path, object] = {}


@pytest.fixture(params=REAL_TRACES, ids=lambda p: p.name.split(".")[0])
def real_prep(request):
    """Each real trace in turn, prepared for replay (cached for the session)."""
    path = request.param
    if path not in _PREPARED:
        _PREPARED[path] = prepare(read_trace(path), name=path.name)
    return _PREPARED[path]
