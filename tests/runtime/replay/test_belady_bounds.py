"""Belady on the real traces: between the cold-miss floor and forced-admission Belady."""
from __future__ import annotations

import numpy as np
import pytest

from hypothesis import given, settings
from hypothesis import strategies as st

from runtime.replay.belady import NEVER, belady_ceiling, cold_miss_bytes, forced_belady, next_use
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


def _assert_same(cell, ref):
    assert (cell.prefill.misses, cell.decode.misses) == ref.misses
    assert (cell.prefill.demand_miss_bytes, cell.decode.demand_miss_bytes) == \
        ref.demand_miss_bytes
    assert (cell.prefill.transient_uses, cell.decode.transient_uses) == ref.transient


@pytest.mark.parametrize("share", SHARES)
def test_manager_belady_equals_the_independent_loops(real_prep, share):
    """The manager's belady / belady-forced make the same decisions as belady.py's loops
    (which is what lets the per-cell ceiling come from the fast loop)."""
    capacity = int(share * real_prep.trace.header.total_expert_bytes)
    nxt = real_prep.next_use()
    for name, ref in (("belady", belady_ceiling(real_prep.trace, capacity, nxt)),
                      ("belady-forced", forced_belady(real_prep.trace, capacity, nxt))):
        cell = replay_cell(real_prep, capacity, preset_config(name), label=name,
                           with_belady=False)
        _assert_same(cell, ref)


@settings(max_examples=30, deadline=None, derandomize=True)
@given(seed=st.integers(0, 10_000), n_layer=st.integers(1, 4), n_expert=st.integers(2, 12),
       k=st.integers(1, 3), prompt=st.integers(0, 12), decode=st.integers(1, 12),
       chunk=st.integers(1, 6), capacity=st.integers(1, 40_000))
def test_loops_agree_with_the_manager_on_odd_shapes(seed, n_layer, n_expert, k, prompt,
                                                     decode, chunk, capacity):
    """Varied sizes per layer, tiny capacities (leases, transient uses, several victims)."""
    from runtime.replay.harness import prepare
    k = min(k, n_expert)
    sizes = tuple(1000 + 700 * (layer % 3) for layer in range(n_layer))
    t = synthesize(SynthTraceSpec(n_layer=n_layer, n_expert=n_expert, top_k=k,
                                  prompt_tokens=prompt, decode_tokens=decode, chunk=chunk,
                                  skew=1.0, reuse=0.3, seed=seed, expert_bytes=sizes))
    prep = prepare(t)
    for name, ref in (("belady", belady_ceiling(t, capacity)),
                      ("belady-forced", forced_belady(t, capacity))):
        _assert_same(replay_cell(prep, capacity, preset_config(name), label=name,
                                 with_belady=False), ref)


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


def test_next_use_equals_a_sort_by_key(real_prep):
    """belady.next_use (one backward pass in C) against a plain stable sort by key."""
    keys = real_prep.trace.keys()
    order = np.argsort(keys, kind="stable")
    same = keys[order[1:]] == keys[order[:-1]]
    want = np.full(len(keys), NEVER, dtype=np.int64)
    want[order[:-1][same]] = order[1:][same]
    np.testing.assert_array_equal(next_use(real_prep.trace), want)
