"""The learned policies' models in the C core against the reference (next-visit's weights and
per-layer lists, affinity's table, its prompt chunks, its token neighbours and its plans
further ahead, a routing profile's warm start): the same decisions at every call, on streams
long and wide enough to reach what the random matrix of test_core_reference.py does not; where
it helps, a reference changed on purpose decides otherwise (the check can fail)."""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from runtime.residency.config import PhasePolicies, ResidencyConfig
from runtime.residency.core import CorePolicy
from runtime.residency.cores import make_core
from runtime.residency.policies.factory import make_spec
from tests.runtime.residency.conftest import TINY_COST
from tests.runtime.residency.core_pairs import (AFFINITY_LEAD1, AFFINITY_LEAD2, EXPERT_BYTES,
                                                MOE, N_EXPERT, N_LAYER, NO_PREFETCH, pair,
                                                policy, same_state)


@pytest.mark.parametrize("pf", [AFFINITY_LEAD2, AFFINITY_LEAD1], ids=["lead2", "lead1"])
def test_warm_start_equals_reference(zipf_stream, pf):
    """A routing profile's frequencies and affinity table (used at lead 1: it holds
    consecutive layers) seed both cores alike."""
    pol = policy(("next-visit", {"learning_rate": 0.05}), ("always", {}), pf)
    rng = np.random.default_rng(2)
    freq = rng.uniform(0, 1, (N_LAYER, N_EXPERT))
    table = rng.integers(0, 5, (len(MOE) - 1, N_EXPERT, N_EXPERT)).astype(np.int32)
    count = table.sum(axis=2).astype(np.int32) // 2
    cold, warm = pair(pol), pair(pol)
    for c in warm:
        c.warm_start(freq, table, count)
    s = zipf_stream(30, 3, N_EXPERT, 2, seed=8)
    outs = {}
    for name, cores in (("cold", cold), ("warm", warm)):
        for c in cores:
            c.set_capacity(0, 450)
        for t in range(30):
            for i, layer in enumerate(MOE):
                out = [c.access(layer, s[t, i].astype(np.int32), 1) for c in cores]
                assert out[0] == out[1]
                outs.setdefault(name, []).append(out[0])
        same_state(cores)
    assert outs["cold"] != outs["warm"]            # the profile changed decisions


def test_affinity_16_bit_table_halves_as_the_reference(zipf_stream, monkeypatch):
    """A profile of a long run (counts near 65535): the C core's 16-bit table halves a row and
    its count when the count would pass 65535, as the reference does. The stream is one where
    the halving decides: the reference without the cap prefetches otherwise."""
    import runtime.residency.reference.affinity as ref_affinity
    pol = policy(("lru", {}), ("always", {}), AFFINITY_LEAD1)
    # every count at the cap; odd experts one pair above even ones: ahead until a row is
    # halved, tied (the lower id first) after
    count = np.full((len(MOE) - 1, N_EXPERT), 65535, dtype=np.int32)
    table = np.broadcast_to(60000 + np.arange(N_EXPERT) % 2,
                            (len(MOE) - 1, N_EXPERT, N_EXPERT)).astype(np.int32)
    s = zipf_stream(40, 3, N_EXPERT, 2, seed=9)

    def run(cores):
        outs = []
        for c in cores:
            c.warm_start(np.zeros((N_LAYER, N_EXPERT)), table, count)
            c.set_capacity(0, 450)
        for t in range(40):
            for i, layer in enumerate(MOE):
                outs.append([c.access(layer, s[t, i].astype(np.int32), 1) for c in cores])
        return outs

    outs = run(pair(pol))
    assert all(a == b for a, b in outs)
    monkeypatch.setattr(ref_affinity, "COUNT_MAX", 1 << 40)
    uncapped = run([make_core("reference", N_LAYER, N_EXPERT, EXPERT_BYTES, pol)])
    assert [o[0] for o in outs] != [o[0] for o in uncapped]


W_LAYER, W_EXPERT, W_MOE = 4, 40, [0, 1, 3]   # wider than next-visit's per-layer list (8)
W_BYTES = [100, 100, 0, 100]


@pytest.mark.parametrize("pf", [NO_PREFETCH, AFFINITY_LEAD1], ids=["none", "affinity"])
@pytest.mark.parametrize("warm", [False, True], ids=["cold", "warm"])
def test_next_visit_wide_layers_equal_reference(zipf_stream, pf, warm):
    """Layers of 40 experts, about 15 resident each: the C search's per-layer lists of the
    lowest keys (nv_victim.h), their re-sort after each weight update and their refills decide
    as the reference's full sort, through a prefill chunk, leases held until the next
    layer-step (the live hooks' pattern) and about a hundred weight updates."""
    pol = policy(("next-visit", {"learning_rate": 0.05}), ("always", {}), pf)
    cores = [make_core(kind, W_LAYER, W_EXPERT, W_BYTES, pol)
             for kind in ("native", "reference")]
    rng = np.random.default_rng(3)
    for c in cores:
        assert c.set_capacity(0, 100 * 45) == 0
        if warm:
            freq = rng.uniform(0, 1.5, (W_LAYER, W_EXPERT)) if c is cores[0] else freq
            table = (rng.integers(0, 5, (len(W_MOE) - 1, W_EXPERT, W_EXPERT)).astype(np.int32)
                     if c is cores[0] else table)
            c.warm_start(freq, table, table.sum(axis=2).astype(np.int32) // 2)
    s = zipf_stream(100, len(W_MOE), W_EXPERT, 4, seed=11)
    for i, layer in enumerate(W_MOE):              # a 4-token prefill chunk
        chunk = s[:4, i].reshape(-1).astype(np.int32)
        out = [c.access(layer, chunk, 0) for c in cores]
        assert out[0] == out[1]
    held = 0
    for t in range(4, 100):
        for i, layer in enumerate(W_MOE):
            lease = 1000 + t * len(W_MOE) + i
            out = [c.access(layer, s[t, i].astype(np.int32), 1, lease_id=lease,
                            release_id=held) for c in cores]
            assert out[0] == out[1], (t, layer)
            assert cores[0].verify() == 0, (t, layer)   # the lists' invariants (nvv_verify)
            held = lease
    for c in cores:
        c.release(held)
    same_state(cores)


def test_next_visit_key_above_a_full_list_stays_out(zipf_stream):
    """A key that joins a layer whose list held all its keys (8, the list's size) and ranks
    above them stays out of the list: it once overran into the next layer's list (or past the
    last one). Here a prefill prefetch (chunk-plan) brings such a key into the last layer."""
    pol = policy(("next-visit", {"learning_rate": 0.05}), ("always", {}),
                 ("chunk-plan", {"depth": 1.0}))
    n_expert, n_layer = 12, 3
    cores = [make_core(kind, n_layer, n_expert, [100] * n_layer, pol)
             for kind in ("native", "reference")]
    for c in cores:
        assert c.set_capacity(0, 100 * 24) == 0
    s = zipf_stream(40, n_layer, n_expert, 2, seed=1)
    steps = [(layer, s[4 * k:4 * k + 4, layer].reshape(-1), 0) for k in range(3)
             for layer in range(n_layer)]
    steps += [(layer, s[t, layer], 1) for t in range(12, 40) for layer in range(n_layer)]
    for j, (layer, experts, phase) in enumerate(steps):
        out = [c.access(layer, experts.astype(np.int32), phase) for c in cores]
        assert out[0] == out[1], j
        assert cores[0].verify() == 0, j           # (7: a list overran)
    same_state(cores)


@pytest.mark.parametrize("pf", [AFFINITY_LEAD2, AFFINITY_LEAD1], ids=["lead2", "lead1"])
def test_affinity_learns_prompt_chunks_equal_reference(zipf_stream, pf):
    """With the model's experts per token known, prefetch affinity also learns its pairs from
    the prompt's chunks (token-major rows, 2 per token: two chunks of 5 tokens, then a
    1-token chunk), the same way in both cores; the prompt's pairs change decode's plans."""
    base = policy(("next-visit", {"learning_rate": 0.05}), ("always", {}), pf)
    s = zipf_stream(40, len(MOE), N_EXPERT, 2, seed=4)
    steps = [(layer, s[a:b, i].reshape(-1), 0) for a, b in ((0, 5), (5, 10), (10, 11))
             for i, layer in enumerate(MOE)]
    steps += [(layer, s[t, i], 1) for t in range(11, 40) for i, layer in enumerate(MOE)]
    outs = {}
    for k in (0, 2):
        cores = pair(replace(base, n_expert_used=k))
        for c in cores:
            c.set_capacity(0, 450)
        for j, (layer, experts, phase) in enumerate(steps):
            out = [c.access(layer, experts.astype(np.int32), phase) for c in cores]
            assert out[0] == out[1], (k, j)
            outs.setdefault(k, []).append(out[0])
        same_state(cores)
    assert outs[0] != outs[2]                      # the prompt's pairs changed decisions


def test_affinity_neighbours_equal_reference(zipf_stream, monkeypatch):
    """The token-neighbour vote of prefetch affinity (neighbours.h) in both cores: a prompt
    chunk of 150 tokens, then 250 decode tokens (both longer than its 128-token history, so
    tokens leave it), skewed routing (its most common experts are not matched). Both cores
    decide the same at every call; a reference whose vote is off decides otherwise."""
    import runtime.residency.reference.neighbours as ref_nb
    n_layer, n_expert, k = 5, 24, 2
    pol = replace(policy(("next-visit", {"learning_rate": 0.05}), ("always", {}), AFFINITY_LEAD1),
                  n_expert_used=k)
    s = zipf_stream(400, n_layer, n_expert, k, seed=7)
    steps = [(layer, s[:150, layer].reshape(-1), 0) for layer in range(n_layer)]
    steps += [(layer, s[t, layer], 1) for t in range(150, 400) for layer in range(n_layer)]

    def run(kind):
        c = make_core(kind, n_layer, n_expert, [100] * n_layer, pol)
        c.set_capacity(0, 900)
        return c, [c.access(layer, ex.astype(np.int32), ph) for layer, ex, ph in steps]

    (native, out_n), (ref, out_r) = run("native"), run("reference")
    assert out_n == out_r
    same_state([native, ref])
    monkeypatch.setattr(ref_nb, "K", 0)            # no token votes
    assert run("reference")[1] != out_n


def test_warm_start_neighbour_history_equals_reference(zipf_stream):
    """A profile's neighbour history (its last decode tokens, -1 padded) seeds affinity's
    token neighbours alike in both cores, and changes what the first decode tokens prefetch."""
    n_layer, n_expert, k = 5, 24, 2
    pol = replace(policy(("lru", {}), ("always", {}), AFFINITY_LEAD1), n_expert_used=k)
    s = zipf_stream(100, n_layer, n_expert, k, seed=9)
    history = s[:40].astype(np.int16)
    history[5, 1, 1] = -1                          # a layer-step with one expert
    freq = np.zeros((n_layer, n_expert))
    table = np.zeros((n_layer - 1, n_expert, n_expert), dtype=np.int32)
    count = np.zeros((n_layer - 1, n_expert), dtype=np.int32)
    outs = {}
    for name, hist in (("without", None), ("with", history)):
        cores = [make_core(kind, n_layer, n_expert, [100] * n_layer, pol)
                 for kind in ("native", "reference")]
        for c in cores:
            c.set_capacity(0, 900)
            c.warm_start(freq, table, count, hist)
        for t in range(40, 100):
            for layer in range(n_layer):
                out = [c.access(layer, s[t, layer].astype(np.int32), 1) for c in cores]
                assert out[0] == out[1], (name, t, layer)
                outs.setdefault(name, []).append(out[0])
        same_state(cores)
    assert outs["without"] != outs["with"]


def test_affinity_plans_further_ahead_equals_reference(monkeypatch):
    """When the link cannot carry a transfer to layer i + lead in time but is idle, affinity
    plans the nearest layer up to lead further ahead from the neighbours' vote alone (12 token
    types, each routed to its own pair of experts at every layer; a GPU fast enough that a
    layer-step of hits gives the link little time). Both cores decide the same at every call,
    and such plans are made."""
    import runtime.residency.reference.affinity as ref_af

    n_layer, n_expert, k = 8, 32, 2
    rng = np.random.default_rng(5)
    route = [[[(2 * t + 3 * i) % n_expert, (2 * t + 1 + 3 * i) % n_expert]
              for i in range(n_layer)] for t in rng.integers(0, 12, 260).tolist()]
    steps = [(i, np.array([e for tok in route[:40] for e in tok[i]]), 0) for i in range(n_layer)]
    steps += [(i, np.array(tok[i]), 1) for tok in route[40:] for i in range(n_layer)]
    pp = PhasePolicies(admission=make_spec("admission", "always"),
                       prefetch=make_spec("prefetch", "affinity", {
                           "top_n": 2.0, "min_precision": 0.2, "layer_us": 0.006}),
                       eviction=make_spec("eviction", "next-visit", {"learning_rate": 0.05}))
    cost = replace(TINY_COST, gpu_mem_gbps=1000.0)     # a hit: 2.5 bytes of link time
    pol = replace(CorePolicy.from_config(ResidencyConfig(phase_specific=False, prefill=pp,
                                                         decode=pp, cost=cost)),
                  n_expert_used=k)
    further = []
    plan_further = ref_af.AffinityModel._plan_further

    def counted(self, *args):
        got = plan_further(self, *args)
        further.append(len(got))
        return got

    monkeypatch.setattr(ref_af.AffinityModel, "_plan_further", counted)
    cores = [make_core(kind, n_layer, n_expert, [100] * n_layer, pol)
             for kind in ("native", "reference")]
    for c in cores:
        c.set_capacity(0, 1200)
    for j, (layer, experts, phase) in enumerate(steps):
        out = [c.access(layer, experts.astype(np.int32), phase) for c in cores]
        assert out[0] == out[1], j
    same_state(cores)
    assert sum(1 for n in further if n) >= 5        # plans further ahead were issued


def test_warm_start_refuses_a_history_the_core_cannot_take():
    """The native core reads a warm start's history as given; one of the wrong shape, with
    ids out of range, repeated within a layer-step or after the pad, is refused before."""
    n_layer, n_expert = 5, 24
    pol = replace(policy(("lru", {}), ("always", {}), AFFINITY_LEAD1), n_expert_used=2)
    core = make_core("native", n_layer, n_expert, [100] * n_layer, pol)
    freq = np.zeros((n_layer, n_expert))
    table = np.zeros((n_layer - 1, n_expert, n_expert), dtype=np.int32)
    count = np.zeros((n_layer - 1, n_expert), dtype=np.int32)
    good = np.array([[[1, 2]] * n_layer] * 3, dtype=np.int16)
    core.warm_start(freq, table, count, good)
    for bad in (good[:, :-1], np.where(good == 2, n_expert, good), np.where(good == 2, 1, good),
                np.where(good == 1, -1, good), np.where(good == 2, -2, good)):
        with pytest.raises(ValueError, match="history must be"):
            core.warm_start(freq, table, count, bad)
