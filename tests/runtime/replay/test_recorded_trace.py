"""A trace recorded from a synthetic model (real llama.cpp run) replays end to end, and its
`lru` and `belady` cells pass the same checks as the real traces."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from runtime.replay.belady import belady_ceiling, cold_miss_bytes, forced_belady
from runtime.traces.files import read_trace

from .test_lru_reference import reference_lru

REPO = Path(__file__).resolve().parents[3]


def _cli(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    return subprocess.run([sys.executable, "-m", "runtime.cli", *map(str, args)],
                          capture_output=True, text=True, timeout=300, cwd=REPO, env=env)


def test_recorded_trace_replays_end_to_end(tiny_model, tmp_path):
    rtb = tmp_path / "rec.rtb"
    rec = _cli("trace", "record", "-m", tiny_model, "-p", "Once upon a time, in a small town",
               "-n", "24", "--temp", "0", "-c", "512", "-t", "1", "-o", rtb)
    assert rec.returncode == 0, rec.stderr
    csv = tmp_path / "rec.csv"
    assert _cli("trace", "convert", rtb, csv).returncode == 0
    trace = read_trace(rtb)
    total = trace.header.total_expert_bytes
    out = _cli("replay", rtb, csv, "--capacity", "25%", "--capacity", "50%", "--policy", "lru",
               "--policy", "belady", "--json")
    assert out.returncode == 0, out.stderr
    cells = json.loads(out.stdout)
    assert len(cells) == 2 * 2 * 2
    for cell in cells:
        cap = cell["capacity_bytes"]
        assert cap in (int(0.25 * total), int(0.5 * total))
        assert cell["prefill"]["accesses"] + cell["decode"]["accesses"] == len(trace)
        assert cell["decode"]["accesses"] == 23 * trace.header.n_layer * \
            trace.header.n_expert_used
        assert cell["cold_miss_bytes"] == cold_miss_bytes(trace)
        ceiling = belady_ceiling(trace, cap)
        assert cell["belady_demand_miss_bytes"] == ceiling.total_demand_miss_bytes
        missed = cell["prefill"]["demand_miss_bytes"] + cell["decode"]["demand_miss_bytes"]
        if cell["policy"] == "lru":
            ref = reference_lru(trace, cap)
            for phase, name in ((0, "prefill"), (1, "decode")):
                assert (cell[name]["hits"], cell[name]["misses"],
                        cell[name]["demand_miss_bytes"]) == \
                    (ref[phase]["hits"], ref[phase]["misses"], ref[phase]["demand_miss_bytes"])
            assert missed >= cell["belady_demand_miss_bytes"]
        else:
            assert missed == cell["belady_demand_miss_bytes"]
            assert cell["cold_miss_bytes"] <= missed <= \
                forced_belady(trace, cap).total_demand_miss_bytes
    # the CSV copy replays to the same numbers as the binary original
    by_file = {}
    for cell in cells:
        key = (cell["policy"], cell["capacity_bytes"])
        by_file.setdefault(key, []).append({k: v for k, v in cell.items() if k != "trace"})
    assert all(a == b for a, b in by_file.values())
