"""Belady on the real traces: between the cold-miss floor and forced-admission Belady."""
from __future__ import annotations

import numpy as np
import pytest

from runtime.replay.belady import NEVER, cold_miss_bytes, forced_belady, next_use
from runtime.replay.harness import replay_cell
from runtime.residency.config import preset_config
from runtime.traces.synthetic import SynthTraceSpec, synthesize

SHARES = [0.004, 0.10, 0.20, 0.30]


def test_next_use_against_a_plain_scan():
    t = synthesize(SynthTraceSpec(n_layer=3, n_expert=8, top_k=2, prompt_tokens=6,
                                  decode_tokens=6, chunk=4))
    keys = t.keys().tolist()
    want = []
    for i, k in enumerate(keys):
        nxt = next((j for j in range(i + 1, len(keys)) if keys[j] == k), NEVER)
        want.append(nxt)
    assert next_use(t).tolist() == want


def test_cold_miss_bytes_counts_distinct_keys():
    t = synthesize(SynthTraceSpec(n_layer=2, n_expert=8, top_k=2, prompt_tokens=5,
                                  decode_tokens=5, expert_bytes=(10, 1000)))
    pairs = set(zip(t.layer.tolist(), t.expert.tolist()))
    assert cold_miss_bytes(t) == sum(10 if layer == 0 else 1000 for layer, _ in pairs)


@pytest.mark.parametrize("share", SHARES)
def test_belady_between_cold_floor_and_forced_belady(real_prep, share):
    capacity = int(share * real_prep.trace.header.total_expert_bytes)
    cell = replay_cell(real_prep, capacity, preset_config("belady"), label="belady")
    forced = forced_belady(real_prep.trace, capacity, real_prep.next_use())
    assert cell.demand_miss_bytes <= forced.total_demand_miss_bytes
    assert cell.demand_miss_bytes >= cell.cold_miss_bytes == cold_miss_bytes(real_prep.trace)
    assert cell.belady_demand_miss_bytes == cell.demand_miss_bytes
    # and every online policy sits above the ceiling
    for name in ("lru", "lfu"):
        other = replay_cell(real_prep, capacity, preset_config(name), label=name)
        assert other.demand_miss_bytes >= cell.demand_miss_bytes
        assert other.belady_demand_miss_bytes == cell.demand_miss_bytes


@pytest.mark.parametrize("share", SHARES)
def test_manager_forced_belady_equals_the_independent_loop(real_prep, share):
    capacity = int(share * real_prep.trace.header.total_expert_bytes)
    cell = replay_cell(real_prep, capacity, preset_config("belady-forced"),
                       label="belady-forced", with_belady=False)
    ref = forced_belady(real_prep.trace, capacity, real_prep.next_use())
    assert (cell.prefill.misses, cell.decode.misses) == ref.misses
    assert (cell.prefill.demand_miss_bytes, cell.decode.demand_miss_bytes) == \
        ref.demand_miss_bytes
    assert (cell.prefill.transient_uses, cell.decode.transient_uses) == ref.transient


def _one_layer_trace(seq):
    from runtime.traces.trace import RouteTrace, TraceHeader
    n = len(seq)
    h = TraceHeader(model="m", arch="a", n_layer=1, n_expert=4, n_expert_used=1,
                    expert_bytes=(1,), dense_bytes=(0,))
    return RouteTrace.from_columns(h, turn=np.zeros(n), phase=np.ones(n), step=np.arange(n),
                                   layer=np.zeros(n), slot=np.zeros(n), expert=np.array(seq),
                                   weight=np.ones(n))


def test_belady_by_hand():
    # room for 2 one-byte experts; decode routes one expert per step
    t = _one_layer_trace([0, 1, 2, 0, 1, 3, 0, 1])
    # forced: 0 1 miss; 2 miss evicts 1 (0 is needed sooner); 0 hit; 1 miss evicts 2 (never
    # again); 3 miss evicts 1 (0 is needed sooner); 0 hit; 1 miss -> 6 misses
    assert forced_belady(t, 2).misses == (0, 6)
    # with bypass, 2 and 3 (never used again) are not admitted: 0 1 2 3 miss, the rest hit
    from runtime.replay.harness import prepare
    cell = replay_cell(prepare(t), 2, preset_config("belady"), label="belady")
    assert (cell.decode.misses, cell.decode.hits, cell.decode.transient_uses) == (4, 4, 2)
