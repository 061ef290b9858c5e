"""The soak (scripts/soak.py) for a minute: ``serve -np 4`` under mixed OpenAI / llama-server
/ streamed / structured / tool traffic with clients that hang up, invalid requests and broken
slot files. No 5xx, no malformed answer (NaN in JSON included), every invalid request a 4xx in
its route's shape, every broken slot refused and then serving, /metrics' request totals
equal to what the clients sent, the server alive and its log free of tracebacks."""
from __future__ import annotations

import importlib.util
import sys

import pytest

from tests.runtime.server.conftest import REPO_ROOT


def _soak_module():
    spec = importlib.util.spec_from_file_location("soak", REPO_ROOT / "scripts" / "soak.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["soak"] = module                  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_a_minute_of_mixed_hostile_traffic(tiny_model):
    report = _soak_module().soak(str(tiny_model), minutes=0.95, clients=6, seed=23)
    outcomes = report["outcomes"]
    assert report["ok"], report
    for kind in ("ok_chat", "ok_text", "ok_native", "ok_structured", "ok_tool",
                 "invalid_refused", "slot_attack_refused"):
        assert outcomes.get(kind, 0) > 0, outcomes
    assert outcomes.get("dropped_waiting", 0) + outcomes.get("dropped_streaming", 0) > 0
    assert 0 < report["metrics"]["cancelled_total"]
    assert report["metrics"]["mismatched"] == {}
    assert report["rss_mib"]["growth"] < 0.25, report["rss_mib"]     # one minute: loose
