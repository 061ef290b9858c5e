"""Fixtures for trace tests: the two real traces (see data/README.md)."""
from __future__ import annotations

from pathlib import Path

import pytest

DATA = Path(__file__).parent / "data"
REAL_TRACES = sorted(DATA.glob("*.route.csv"))
assert len(REAL_TRACES) == 2, f"expected the two real traces in {DATA}"


@pytest.fixture(params=REAL_TRACES, ids=lambda p: p.name.split(".")[0])
def real_trace_path(request) -> Path:
    """Each real route_trace v1 CSV in turn."""
    return request.param


@pytest.fixture
def good_csv_text() -> str:
    """A small valid trace: 2 layers x 4 experts, top-2; prefill 2 tokens, decode 1 token."""
    return "\n".join([
        "# route_trace v1",
        "# model=/models/tiny.gguf arch=qwen3moe n_layer=2 n_expert=4 n_expert_used=2",
        "# layer=0 expert_bytes=1000 dense_bytes=50",
        "# layer=1 expert_bytes=2000 dense_bytes=60",
        "turn,phase,step,layer,slot,expert,weight,residency,expert_bytes",
        "0,0,0,0,0,1,0.6,0,1000",      # line 6
        "0,0,0,0,1,2,0.4,0,1000",
        "0,0,1,0,0,1,0.7,1,0",
        "0,0,1,0,1,3,0.3,0,1000",
        "0,0,1,1,0,0,0.5,0,2000",      # line 10
        "0,0,1,1,1,2,0.5,0,2000",
        "0,1,2,0,0,3,0.9,0,1000",
        "0,1,2,0,1,0,0.1,0,1000",
        "0,1,2,1,0,0,0.8,0,2000",
        "0,1,2,1,1,1,0.2,0,2000",      # line 15
    ]) + "\n"
