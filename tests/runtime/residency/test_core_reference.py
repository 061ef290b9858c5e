"""The C residency core against its Python reference: the same calls give the same results,
counters and key states, for every policy, with leases, prefetch, pools, failed transfers,
reconfiguration and rejected calls; the replay loop as the calls it stands for. The learned
policies' models (next-visit, affinity) on the streams that reach them:
test_learned_reference.py."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from runtime.errors import UserError
from runtime.residency.core import CoreError, CorePolicy
from runtime.residency.cores import make_core
from runtime.residency.policies.factory import param_defaults
from tests.runtime.residency.conftest import live_policies
from tests.runtime.residency.core_pairs import (AFFINITY_LEAD1, AFFINITY_LEAD2, EXPERT_BYTES,
                                                MOE, N_EXPERT, N_LAYER, POPULARITY, pair, policy,
                                                same_state)


def defaults(role: str) -> list[tuple[str, dict]]:
    """(name, default parameters) of each live policy of ``role`` (not offline), from the
    registry: a new policy is compared against its reference with no test edit."""
    return [(name, param_defaults(role, name)) for name in live_policies(role)]


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


def outcome(call, *args, **kw):
    """A core call's CoreAccess, or ("refused", status, bad value): comparable across cores."""
    try:
        return call(*args, **kw)
    except CoreError as err:
        return ("refused", err.status, err.bad_value)


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
