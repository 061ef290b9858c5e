"""Honest prefetch timing (runtime/replay/timing.py): a prefetch is a hit only if the link
carried it before its first use; a late one is a demand miss; unused bytes are waste."""
from __future__ import annotations

import numpy as np
import pytest

from runtime.replay.harness import replay_cell
from runtime.replay.timing import fifo_finish
from runtime.residency.config import load_config


def test_fifo_finish_equals_a_loop():
    rng = np.random.default_rng(3)
    issue = np.sort(rng.uniform(0, 10, 500))
    service = rng.uniform(0, 0.05, 500)
    want, free = np.empty(500), 0.0
    for i in range(500):
        free = max(free, issue[i]) + service[i]
        want[i] = free
    got = fifo_finish(issue, service)
    print("max |fifo_finish - loop| =", float(np.abs(got - want).max()))
    assert np.allclose(got, want, rtol=0, atol=1e-9)


def _config(tmp_path, link_gbps: float):
    path = tmp_path / f"pf-{link_gbps:g}.toml"
    path.write_text('[policy]\nphase_specific = false\n[policy.decode]\neviction = "lru"\n'
                    'prefetch = "popularity"\nprefetch_params = { top_n = 4 }\n'
                    f'[cost]\nlink_gbps = {link_gbps}\n')
    return load_config(path)


@pytest.mark.parametrize("share", [0.10])
def test_late_prefetches_are_demand_misses(real_prep, tmp_path, share):
    cap = int(share * real_prep.trace.header.total_expert_bytes)
    fast = replay_cell(real_prep, cap, _config(tmp_path, 1e6), label="fast", with_belady=False)
    slow = replay_cell(real_prep, cap, _config(tmp_path, 0.001), label="slow", with_belady=False)
    mid = replay_cell(real_prep, cap, _config(tmp_path, 25.0), label="mid", with_belady=False)
    f, s, m = fast.decode, slow.decode, mid.decode
    # the same decisions: the core never looks at the clock
    assert f.prefetch_issued_bytes == s.prefetch_issued_bytes == m.prefetch_issued_bytes > 0
    assert f.admissions == s.admissions and f.evictions == s.evictions
    # an unlimited link delivers every prefetch in time; a tiny one none
    assert f.prefetch_late_bytes == 0 and f.prefetch_used_bytes > 0
    assert s.prefetch_used_bytes == 0 and s.prefetch_late_bytes == f.prefetch_used_bytes
    assert s.demand_miss_bytes == f.demand_miss_bytes + s.prefetch_late_bytes
    assert s.misses > f.misses and s.hits < f.hits
    assert f.demand_miss_bytes <= m.demand_miss_bytes <= s.demand_miss_bytes
    # every prefetched byte is used in time, late, or wasted (over both phases)
    for cell in (fast, slow, mid):
        issued = cell.prefill.prefetch_issued_bytes + cell.decode.prefetch_issued_bytes
        parts = sum(getattr(p, k) for p in (cell.prefill, cell.decode)
                    for k in ("prefetch_used_bytes", "prefetch_late_bytes",
                              "prefetch_wasted_bytes"))
        assert parts == issued
        assert cell.decode.bytes_moved == (cell.decode.demand_miss_bytes
                                           + cell.decode.prefetch_issued_bytes
                                           - cell.decode.prefetch_late_bytes)
