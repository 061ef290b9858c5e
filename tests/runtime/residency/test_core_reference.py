"""The C residency core against its Python reference: the same calls give the same results,
counters and key states, for every policy, with leases, prefetch, pools, failed transfers,
reconfiguration and rejected calls."""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from runtime.errors import UserError
from runtime.residency.config import PhasePolicies, PolicySpec, ResidencyConfig
from runtime.residency.core import CoreError, CorePolicy
from runtime.residency.cores import make_core
from runtime.residency.policies.factory import make_spec, param_defaults
from tests.runtime.residency.conftest import TINY_COST, live_policies



def defaults(role: str) -> list[tuple[str, dict]]:
    """(name, default parameters) of each live policy of ``role`` (not offline), from the
    registry: a new policy is compared against its reference with no test edit."""
    return [(name, param_defaults(role, name)) for name in live_policies(role)]


NO_PREFETCH = ("none", {})
POPULARITY = ("popularity", {"top_n": 2.0})
# TINY_COST: a transfer costs its bytes + 5; a layer-step of 2 experts gives the link 200-600
# bytes of time. 150 bytes per typical layer-step: a lead of 2 MoE layers (ceil(2 * 155 / 150)
# = 3, at most n_moe - 1); 500 bytes per typical layer-step: the next layer (lead 1)
AFFINITY_LEAD2 = ("affinity", {"top_n": 2.0, "min_precision": 0.2, "layer_us": 0.006})
AFFINITY_LEAD1 = ("affinity", {"top_n": 2.0, "min_precision": 0.2, "layer_us": 0.02})
# beside each policy's defaults, parameters that reach what a 60-call stream does not reach
# with them: a half-life and a window of a few accesses, a faster learning rate, other weights,
# and affinity at leads 2 and 1 on TINY_COST's link
VARIANTS = {
    "eviction": [("lfu-decay", {"half_life": 16.0}), ("next-visit", {"learning_rate": 0.05}),
                 ("phase-weighted", {"w_prefill": 1.0, "w_decode": 3.0})],
    "admission": [("transient-on-pressure", {"window": 20.0})],
    "prefetch": [POPULARITY, AFFINITY_LEAD2, AFFINITY_LEAD1],
}
EVICTIONS = defaults("eviction") + VARIANTS["eviction"]
ADMISSIONS = defaults("admission") + VARIANTS["admission"]
PREFETCHES = defaults("prefetch") + VARIANTS["prefetch"]
MATRIX = {"eviction": EVICTIONS, "admission": ADMISSIONS, "prefetch": PREFETCHES}
N_LAYER, N_EXPERT = 4, 6
EXPERT_BYTES = [100, 0, 150, 100]          # a dense layer, two expert sizes
MOE = [0, 2, 3]


def policy(ev, ad, pf, ev2=None) -> CorePolicy:
    def phase(e):
        return PhasePolicies(admission=make_spec("admission", ad[0], ad[1]),
                             prefetch=make_spec("prefetch", pf[0], pf[1]),
                             eviction=make_spec("eviction", e[0], e[1]))
    cfg = ResidencyConfig(phase_specific=ev2 is not None, prefill=phase(ev2 or ev),
                          decode=phase(ev), cost=TINY_COST)
    return CorePolicy.from_config(cfg)


def pair(pol: CorePolicy):
    return [make_core(kind, N_LAYER, N_EXPERT, EXPERT_BYTES, pol)
            for kind in ("native", "reference")]


def outcome(call, *args, **kw):
    """A core call's CoreAccess, or ("refused", status, bad value): comparable across cores."""
    try:
        return call(*args, **kw)
    except CoreError as err:
        return ("refused", err.status, err.bad_value)


def same_state(cores) -> None:
    native, ref = cores
    assert np.array_equal(native.states(), ref.states())
    assert native.n_pool == ref.n_pool
    for p in range(native.n_pool):
        assert native.pool_stats(p) == ref.pool_stats(p)
        for ph in range(3):
            assert native.counters(p, ph) == ref.counters(p, ph)
    assert native.verify() == 0 and ref.verify() == 0
    assert native.n_leases == ref.n_leases


ops = st.lists(st.tuples(
    st.sampled_from(["access", "access", "access", "hold", "release", "prefetch", "forget",
                     "capacity", "bad", "step", "step", "step_end"]),
    st.sampled_from(MOE), st.lists(st.integers(0, N_EXPERT - 1), min_size=1, max_size=7),
    st.integers(0, 2), st.integers(0, 10)), min_size=5, max_size=60)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ev=st.sampled_from(EVICTIONS), ad=st.sampled_from(ADMISSIONS),
       pf=st.sampled_from(PREFETCHES), ev2=st.sampled_from([None, *EVICTIONS]),
       pools=st.booleans(), steps=ops)
def test_core_equals_reference(ev, ad, pf, ev2, pools, steps):
    run_ops(pair(drawn_policy(ev, ad, pf, ev2)), pools, steps)


@pytest.mark.parametrize("role,name", [pytest.param(role, name, id=f"{role}-{name}")
                                       for role in ("eviction", "admission", "prefetch")
                                       for name, _ in defaults(role)])
@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), pools=st.booleans(), steps=ops)
def test_each_policy_equals_reference(role, name, data, pools, steps):
    """Each live policy of the registry, at its defaults, in every call of the random
    matrix above (the other roles drawn from it)."""
    pick = {r: (name, param_defaults(role, name)) if r == role else
            data.draw(st.sampled_from(MATRIX[r]), label=r) for r in MATRIX}
    ev2 = data.draw(st.sampled_from([None, *EVICTIONS]), label="prefill eviction")
    run_ops(pair(drawn_policy(pick["eviction"], pick["admission"], pick["prefetch"], ev2)),
            pools, steps)


def drawn_policy(ev, ad, pf, ev2) -> CorePolicy:
    """policy(...) of a drawn combination; one the config refuses (a policy that keeps one
    model given other parameters in prefill: UserError) is not an example."""
    try:
        return policy(ev, ad, pf, ev2)
    except UserError:
        assume(False)


def run_ops(cores, pools: bool, steps) -> None:
    """The random calls ``steps`` on both cores, which must agree after each."""
    if pools:                                  # layers 0 and 3 share a pool, layer 2 its own
        for c in cores:
            assert c.set_pools([0, -1, 1, 0], [400, 300]) == 0
    else:
        for c in cores:
            assert c.set_capacity(0, 550) == 0
    leases: list[int] = []
    held = 0                                   # a stepping consumer's lease (the core's step)
    for op, layer, experts, phase, pick in steps:
        if op in ("access", "hold", "bad"):
            el = list(experts) + ([N_EXPERT + pick] if op == "bad" else [])
            lease = 0
            if op == "hold":                   # the core mints every lease id, in one order
                lease = cores[0].lease_id()
                assert cores[1].lease_id() == lease
            out = [outcome(c.access, layer, np.array(el, dtype=np.int32), phase,
                           lease_id=lease) for c in cores]
            assert out[0] == out[1]
            if out[0][0] != "refused" and lease:
                leases.append(lease)
        elif op == "step":                     # its previous lease ends, refused or not
            el = list(experts) + ([N_EXPERT + pick] if pick == 10 else [])
            out = [outcome(c.step, held, layer, np.array(el, dtype=np.int32), phase)
                   for c in cores]
            assert out[0] == out[1]
            held = 0 if out[0][0] == "refused" else out[0][0]
        elif op == "step_end":
            for c in cores:
                c.step_end(held)
            held = 0
        elif op == "release" and leases:
            lease = leases.pop(pick % len(leases))
            for c in cores:
                c.release(lease)
        elif op == "prefetch":
            flats = [layer * N_EXPERT + e for e in experts]
            out = [outcome(c.prefetch, flats, phase) for c in cores]
            assert out[0] == out[1]
        elif op == "forget":
            flat = layer * N_EXPERT + experts[0]
            assert cores[0].forget(flat) == cores[1].forget(flat)
        elif op == "capacity":
            pool = pick % cores[0].n_pool
            cap = 100 * (pick + 1)
            assert cores[0].set_capacity(pool, cap) == cores[1].set_capacity(pool, cap)
        same_state(cores)


@pytest.mark.parametrize("name", ["belady", "belady-forced"])
def test_offline_policies_equal_reference(zipf_stream, name):
    from runtime.residency.config import preset_config

    pol = CorePolicy.from_config(preset_config(name))
    cores = pair(pol)
    for c in cores:
        c.set_capacity(0, 700)
    s = zipf_stream(60, 3, N_EXPERT, 2, seed=4)
    steps = [(MOE[layer], s[t, layer]) for t in range(60) for layer in range(3)]
    flat = [layer * N_EXPERT + int(e) for layer, ex in steps for e in ex]
    nxt, seen = [2**62] * len(flat), {}
    for i in range(len(flat) - 1, -1, -1):
        nxt[i] = seen.get(flat[i], 2**62)
        seen[flat[i]] = i
    i = 0
    for layer, ex in steps:
        nu = np.array(nxt[i:i + len(ex)], dtype=np.int64)
        i += len(ex)
        out = [c.access(layer, ex.astype(np.int32), 1, next_use=nu) for c in cores]
        assert out[0] == out[1]
    same_state(cores)


def test_replay_loop_equals_access_calls(zipf_stream):
    """The core's batch loop (replay) decides exactly as one access per batch."""
    pol = policy(("lfu", {}), ("always", {}), ("chunk-plan", {"depth": 1.0}))
    s = zipf_stream(40, 3, N_EXPERT, 2, seed=9)
    batches = [(MOE[layer], 0 if t < 5 else 1, s[t, layer]) for t in range(40) for layer in range(3)]
    experts = np.concatenate([b[2] for b in batches]).astype(np.int32)
    bounds = np.concatenate([[0], np.cumsum([len(b[2]) for b in batches])]).astype(np.int64)
    layers = np.array([b[0] for b in batches], dtype=np.int32)
    phases = np.array([b[1] for b in batches], dtype=np.int8)
    for kind in ("native", "reference"):
        a = make_core(kind, N_LAYER, N_EXPERT, EXPERT_BYTES, pol)
        b = make_core(kind, N_LAYER, N_EXPERT, EXPERT_BYTES, pol)
        a.set_capacity(0, 600)
        b.set_capacity(0, 600)
        kinds = np.zeros(len(experts), dtype=np.int8)
        assert a.replay(bounds, layers, phases, experts, None, False, kinds) == 0
        for (layer, phase, ex) in batches:
            b.access(layer, ex.astype(np.int32), phase)
        assert np.array_equal(a.states(), b.states())
        assert a.counters(0, 0) == b.counters(0, 0) and a.counters(0, 1) == b.counters(0, 1)
        admitted = int((kinds == 1).sum())
        assert admitted == a.counters(0, 0)[3] + a.counters(0, 1)[3]


def test_rejected_call_changes_nothing():
    """ids [1, 9] with 9 out of range: nothing touched, so the next victim is the same."""
    pol = policy(("lru", {}), ("always", {}), ("none", {}))
    for kind in ("native", "reference"):
        c = make_core(kind, N_LAYER, N_EXPERT, EXPERT_BYTES, pol)
        c.set_capacity(0, 300)
        for e in (0, 1, 2):
            c.access(0, np.array([e], dtype=np.int32), 1)
        before = (c.states().copy(), c.counters(0, 1))
        assert outcome(c.access, 0, np.array([1, 9], dtype=np.int32), 1) == ("refused", -2, 9)
        assert np.array_equal(c.states(), before[0]) and c.counters(0, 1) == before[1]
        out = c.access(0, np.array([3], dtype=np.int32), 1)
        assert out.evicted == (0,), kind       # lru is still expert 0, not 2


@pytest.mark.parametrize("ev", [("lru", {}), ("next-visit", {"learning_rate": 0.05})])
@pytest.mark.parametrize("pf", [POPULARITY, AFFINITY_LEAD2, AFFINITY_LEAD1],
                         ids=["popularity", "affinity-lead2", "affinity-lead1"])
def test_replay_prefetch_log_equals_reference(zipf_stream, ev, pf):
    """replay's per-row kinds (4: first use of a prefetched key), the prefetch each such row
    used, and the prefetch log (batch, key) are the same in both cores."""
    pol = policy(ev, ("always", {}), pf)
    s = zipf_stream(40, 3, N_EXPERT, 2, seed=5)
    batches = [(MOE[layer], 0 if t < 3 else 1, s[t, layer]) for t in range(40) for layer in range(3)]
    experts = np.concatenate([b[2] for b in batches]).astype(np.int32)
    bounds = np.concatenate([[0], np.cumsum([len(b[2]) for b in batches])]).astype(np.int64)
    layers = np.array([b[0] for b in batches], dtype=np.int32)
    phases = np.array([b[1] for b in batches], dtype=np.int8)
    got = []
    for kind in ("native", "reference"):
        c = make_core(kind, N_LAYER, N_EXPERT, EXPERT_BYTES, pol)
        c.set_capacity(0, 500)
        kinds = np.zeros(len(experts), dtype=np.int8)
        events = np.full(len(experts), -1, dtype=np.int64)
        assert c.replay(bounds, layers, phases, experts, None, False, kinds, events) == 0
        got.append((kinds, events, *c.replay_prefetches(), c.counters(0, 1)))
    (k0, e0, b0, f0, c0), (k1, e1, b1, f1, c1) = got
    assert (k0 == 4).sum() > 0 and len(b0) > 0
    assert np.array_equal(k0, k1) and np.array_equal(e0, e1)
    assert np.array_equal(b0, b1) and np.array_equal(f0, f1) and c0 == c1
    # each use points at a prefetch of its own key, issued in an earlier batch
    rows = np.flatnonzero(k0 == 4)
    batch_of = np.repeat(np.arange(len(bounds) - 1), np.diff(bounds))
    assert np.array_equal(f0[e0[rows]], layers[batch_of[rows]] * N_EXPERT + experts[rows])
    assert (b0[e0[rows]] < batch_of[rows]).all()


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
