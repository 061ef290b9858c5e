"""Snapshots: frozen, JSON, Prometheus text."""
from __future__ import annotations

import dataclasses
import json
import re

import numpy as np
import pytest

from runtime.residency.manager import ExpertResidencyManager
from runtime.residency.types import Phase


def test_snapshot_formats():
    m = ExpertResidencyManager.create_simulated(expert_bytes=[10, 0, 10], n_expert=4,
                                                capacity_bytes=30, policy="lru")
    for layer, ids, phase in [(0, [0, 1], Phase.PREFILL), (2, [3], Phase.DECODE),
                              (0, [0], Phase.DECODE), (2, [2], Phase.DECODE)]:
        m.release(m.access_layer("sim", layer, np.array(ids), phase))
    snap = m.snapshot()
    with pytest.raises(dataclasses.FrozenInstanceError):
        snap.devices = ()
    d = snap.device("sim")
    assert d.capacity_bytes == 30 and d.resident_bytes == 30 and d.resident_experts == 3
    assert d.phase(Phase.PREFILL).misses == 2 and d.phase(Phase.DECODE).transition_hits == 1
    assert d.total.accesses == 5
    data = json.loads(snap.to_json())
    assert data["devices"]["sim"]["phases"]["decode"]["evictions"] == 1
    text = snap.to_prometheus()
    assert 'moe_expert_accesses_total{device="sim",phase="prefill"} 2' in text
    assert 'moe_expert_resident_bytes{device="sim"} 30' in text
    sample = re.compile(r'^moe_expert_[a-z_]+\{[a-z]+="[^"]*"(,[a-z]+="[^"]*")*\} -?\d+$')
    families = set()
    for line in text.strip().splitlines():
        if line.startswith("# HELP "):
            families.add(line.split()[2])
        elif line.startswith("# TYPE "):
            assert line.split()[3] in ("counter", "gauge") and line.split()[2] in families
        else:
            assert sample.match(line), line
            assert line.split("{")[0] in families
    assert {"moe_expert_demand_miss_bytes_total", "moe_expert_transition_hits_total",
            "moe_expert_prefetch_wasted_bytes_total"} <= families


@pytest.mark.parametrize("core", ["native", "reference"])
def test_expert_map(core):
    """snapshot(experts=True): per MoE layer each expert's state and access count; the C
    core and its Python reference agree."""
    m = ExpertResidencyManager.create_simulated(expert_bytes=[10, 0, 10], n_expert=4,
                                                capacity_bytes=30, policy="lru", core=core)
    for layer, ids, phase in [(0, [0, 1], Phase.PREFILL), (2, [3], Phase.DECODE),
                              (0, [0], Phase.DECODE), (2, [2], Phase.DECODE)]:
        m.release(m.access_layer("sim", layer, np.array(ids), phase))
    assert m.snapshot().device("sim").experts is None          # off by default
    experts = m.snapshot(experts=True).device("sim").experts
    assert experts.layers == (0, 2)                              # the dense layer 1 left out
    # capacity 3: (0, 1) was the least recently used when (2, 2) came in
    assert experts.state == ("R---", "--RR")
    assert experts.routed == ((2, 1, 0, 0), (0, 0, 1, 1))
    data = json.loads(m.snapshot(experts=True).to_json())["devices"]["sim"]["experts"]
    assert data == {"layers": [0, 2], "state": ["R---", "--RR"],
                    "routed": [[2, 1, 0, 0], [0, 0, 1, 1]]}
    assert "experts" not in json.loads(m.snapshot().to_json())["devices"]["sim"]
