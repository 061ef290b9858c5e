"""`lru` replay through the manager equals a plain reference loop, exactly, on real traces.

The reference is written from the access semantics in docs/design/contracts.md, nothing
shared with the manager: per layer batch, keys resident at entry hit; every key of the batch
is leased; each distinct missed key (routing order) evicts unleased residents, least recently
used first, until it fits, or is used transiently when the unleased residents are too few.
"""
from __future__ import annotations

from collections import OrderedDict

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from runtime.replay.harness import prepare, replay_cell
from runtime.residency.config import preset_config
from runtime.traces.synthetic import SynthTraceSpec, synthesize


def reference_lru(trace, capacity: int) -> dict[int, dict[str, int]]:
    """Per phase (0 prefill, 1 decode): accesses, hits, misses, demand_miss_bytes, transient."""
    n_expert = trace.header.n_expert
    size_of = list(trace.header.expert_bytes)
    keys = trace.keys().tolist()
    phases = trace.phase.tolist()
    bounds = trace.batch_bounds().tolist()
    lru: OrderedDict[int, None] = OrderedDict()   # resident keys, least recent first
    used = 0                                      # resident bytes
    out = {p: dict(accesses=0, hits=0, misses=0, demand_miss_bytes=0, transient=0)
           for p in (0, 1)}
    for s, e in zip(bounds[:-1], bounds[1:]):
        c = out[phases[s]]
        batch = keys[s:e]
        c["accesses"] += len(batch)
        leased = set(batch)
        resident_at_entry = {k for k in leased if k in lru}
        leased_bytes = sum(size_of[k // n_expert] for k in resident_at_entry)
        missed = [k for k in dict.fromkeys(batch) if k not in resident_at_entry]
        c["hits"] += len(batch) - len(missed)
        for k in missed:
            size = size_of[k // n_expert]
            c["misses"] += 1
            c["demand_miss_bytes"] += size
            if capacity - leased_bytes < size:
                c["transient"] += 1
                continue
            victims, freed = [], 0
            for victim in lru:                    # least recent first
                if used - freed + size <= capacity:
                    break
                if victim not in leased:
                    victims.append(victim)
                    freed += size_of[victim // n_expert]
            for victim in victims:
                del lru[victim]
            used -= freed
            lru[k] = None
            used += size
            leased_bytes += size
        # recency: every key of the batch, ordered by its last occurrence in the batch
        last = {k: i for i, k in enumerate(batch)}
        for k in sorted(last, key=last.get):
            if k in lru:
                lru.move_to_end(k)
    return out


# shares of the model's expert bytes; 0.004 is smaller than one prefill layer's experts, so
# leases force transient uses
SHARES = [0.004, 0.05, 0.10, 0.20, 0.30]


@pytest.mark.parametrize("share", SHARES)
def test_lru_matches_reference_exactly(real_prep, share):
    capacity = int(share * real_prep.trace.header.total_expert_bytes)
    cell = replay_cell(real_prep, capacity, preset_config("lru"), label="lru",
                       with_belady=False)
    ref = reference_lru(real_prep.trace, capacity)
    for phase, got in ((0, cell.prefill), (1, cell.decode)):
        want = ref[phase]
        assert (got.accesses, got.hits, got.misses, got.demand_miss_bytes,
                got.transient_uses) == (want["accesses"], want["hits"], want["misses"],
                                        want["demand_miss_bytes"], want["transient"]), phase
    if share == SHARES[0]:
        assert ref[0]["transient"] > 0  # the small capacity does exercise leases


@settings(max_examples=30, deadline=None, derandomize=True)
@given(seed=st.integers(0, 10_000), n_layer=st.integers(1, 4), n_expert=st.integers(2, 12),
       k=st.integers(1, 3), prompt=st.integers(0, 12), decode=st.integers(1, 12),
       chunk=st.integers(1, 6), capacity=st.integers(1, 40_000))
def test_lru_matches_reference_on_odd_shapes(seed, n_layer, n_expert, k, prompt, decode, chunk,
                                             capacity):
    """Mixed expert sizes and tiny capacities: leases, transient uses, several victims."""
    k = min(k, n_expert)
    sizes = tuple(1000 + 700 * (layer % 3) for layer in range(n_layer))
    t = synthesize(SynthTraceSpec(n_layer=n_layer, n_expert=n_expert, top_k=k,
                                  prompt_tokens=prompt, decode_tokens=decode, chunk=chunk,
                                  skew=1.0, reuse=0.3, seed=seed, expert_bytes=sizes))
    cell = replay_cell(prepare(t), capacity, preset_config("lru"), label="lru",
                       with_belady=False)
    ref = reference_lru(t, capacity)
    for phase, got in ((0, cell.prefill), (1, cell.decode)):
        want = ref[phase]
        assert (got.hits, got.misses, got.demand_miss_bytes, got.transient_uses) == \
            (want["hits"], want["misses"], want["demand_miss_bytes"], want["transient"])


def test_a_miss_that_cannot_be_admitted_evicts_nothing():
    """Contract: with no victim set big enough the miss is used transiently, "no state".
    Layer 1's expert (1700 B) is larger than the whole cache (1000 B): using it must not
    evict layer 0's expert, so layer 0's second access hits."""
    import numpy as np

    from runtime.traces.trace import RouteTrace, TraceHeader
    h = TraceHeader(model="m", arch="a", n_layer=2, n_expert=2, n_expert_used=1,
                    expert_bytes=(1000, 1700), dense_bytes=(0, 0))
    layer, expert = [0, 1, 0], [1, 1, 1]
    t = RouteTrace.from_columns(h, turn=np.zeros(3), phase=np.ones(3), step=[0, 0, 1],
                                layer=layer, slot=np.zeros(3), expert=expert, weight=np.ones(3))
    assert reference_lru(t, 1000)[1] == dict(accesses=3, hits=1, misses=2,
                                             demand_miss_bytes=2700, transient=1)
    cell = replay_cell(prepare(t), 1000, preset_config("lru"), label="lru", with_belady=False)
    assert (cell.decode.hits, cell.decode.misses, cell.decode.transient_uses,
            cell.decode.evictions) == (1, 2, 1, 0)
