"""Eviction next-visit and prefetch affinity: what they do, beyond agreeing with the reference
(test_learned_reference.py)."""
from __future__ import annotations

import math
from dataclasses import replace

import numpy as np

from runtime.residency.config import PhasePolicies, ResidencyConfig
from runtime.residency.core import CorePolicy
from runtime.residency.cores import make_core
from runtime.residency.policies.factory import make_spec
from tests.runtime.residency.conftest import TINY_COST

N_LAYER, N_EXPERT = 3, 8
BYTES = [100, 100, 100]


def _policy(eviction: str, prefetch=("none", {}), cost=TINY_COST) -> CorePolicy:
    pp = PhasePolicies(admission=make_spec("admission", "always"),
                       prefetch=make_spec("prefetch", *prefetch),
                       eviction=make_spec("eviction", eviction))
    return CorePolicy.from_config(ResidencyConfig(phase_specific=False, prefill=pp, decode=pp,
                                                  cost=cost))


def _replay(kind: str, pol: CorePolicy, steps: list[list[list[int]]], capacity: int):
    """steps: per token, per layer, the routed experts (decode)."""
    return _replay_batches(kind, pol, [(layer, ex, 1) for tok in steps
                                       for layer, ex in enumerate(tok)], capacity)


def _prompt_then_decode(prompt, decode, n_layer: int) -> list[tuple[int, list[int], int]]:
    """(layer, experts, phase) batches: the prompt's tokens as one token-major chunk per layer,
    then each decode token layer by layer (prompt, decode: per token, per layer, experts)."""
    batches = [(layer, [e for tok in prompt for e in tok[layer]], 0) for layer in range(n_layer)]
    return batches + [(layer, tok[layer], 1) for tok in decode for layer in range(n_layer)]


def _replay_batches(kind: str, pol: CorePolicy, batches, capacity: int, n_layer: int = N_LAYER,
                    n_expert: int = N_EXPERT, nbytes=None):
    """batches: (layer, experts, phase) in order, through one core's replay. Returns the core,
    each row's miss kind, each row's prefetch event, the prefetch log and each row's batch."""
    experts = np.array([e for _, ex, _ in batches for e in ex], dtype=np.int32)
    bounds = np.concatenate([[0], np.cumsum([len(ex) for _, ex, _ in batches])]).astype(np.int64)
    layers = np.array([b[0] for b in batches], dtype=np.int32)
    phases = np.array([b[2] for b in batches], dtype=np.int8)
    core = make_core(kind, n_layer, n_expert, nbytes or BYTES, pol)
    core.set_capacity(0, capacity)
    kinds = np.zeros(len(experts), dtype=np.int8)
    events = np.full(len(experts), -1, dtype=np.int64)
    assert core.replay(bounds, layers, phases, experts, None, False, kinds, events) == 0
    batch_of = np.repeat(np.arange(len(batches)), np.diff(bounds))
    return core, kinds, events, core.replay_prefetches(), batch_of


def _gated_stream(rng) -> list[list[list[int]]]:
    """40 tokens where layer l + 1's experts follow from layer l's (e -> e + 1, e + 2), then 40
    of independent random routing, then 40 predictable again."""
    out = []
    for t in range(120):
        first = sorted(rng.choice(N_EXPERT, 2, replace=False).tolist())
        if 40 <= t < 80:
            out.append([first] + [sorted(rng.choice(N_EXPERT, 2, replace=False).tolist())
                                  for _ in range(N_LAYER - 1)])
        else:
            out.append([first, [(e + 1) % N_EXPERT for e in first],
                        [(e + 2) % N_EXPERT for e in first]])
    return out


def test_affinity_prefetches_what_follows_and_cuts_back_when_it_does_not_pay():
    steps = _gated_stream(np.random.default_rng(1))
    pol = _policy("lru", ("affinity", {"top_n": 2.0, "min_precision": 0.5, "layer_us": 1.0}))
    results = [_replay(kind, pol, steps, 600) for kind in ("native", "reference")]
    (core, kinds, events, (pf_batch, pf_flat), batch_of), ref = results
    assert np.array_equal(kinds, ref[1]) and np.array_equal(events, ref[2])
    assert np.array_equal(pf_batch, ref[3][0]) and np.array_equal(pf_flat, ref[3][1])
    token = pf_batch // N_LAYER
    issued = [int(((token >= a) & (token < b)).sum()) for a, b in ((10, 40), (50, 80), (90, 120))]
    used = np.zeros(len(pf_batch), dtype=bool)
    used[events[kinds == 4]] = True
    late_used = used[token >= 90].mean()
    print("prefetches issued per phase (predictable, random, predictable):", issued,
          "precision in the last phase:", round(float(late_used), 3))
    # predictable routing: prefetches issued and almost all used; random: the measured hits
    # per predicted hit fall, and with them the calibrated q (the old pairs still rank the
    # same candidates high); it re-measures whenever the decayed tallies fall below warm-up
    assert issued[0] > 20 and issued[2] > 20
    assert issued[1] < issued[0] / 2
    assert late_used > 0.9


def test_next_visit_keeps_the_expert_whose_layer_comes_next():
    """Two experts with the same history, idle equally long: LRU evicts the older one by
    sequence (whose layer comes next in the cycle); next-visit the one whose layer is further
    away (same p, larger layer distance)."""
    steps = [[[0], [0], [1]]]          # capacity 2: layer 2's miss evicts (0, 0) or (1, 0)
    kept = {}
    for name in ("lru", "next-visit"):
        for kind in ("native", "reference"):
            core, *_ = _replay(kind, _policy(name), steps, 200)
            resident = {(int(l), int(e)) for l, e in zip(*np.nonzero(core.states() <= 2))}
            kept.setdefault(name, resident)
            assert kept[name] == resident
    assert kept["lru"] == {(1, 0), (2, 1)}
    assert kept["next-visit"] == {(0, 0), (2, 1)}


def _follow_stream(rng) -> list[list[list[int]]]:
    """Every layer routes expert 0 and one expert a (random per token, the same at every
    layer): 0 is always resident, a often is not."""
    out = []
    for _ in range(80):
        a = int(rng.integers(1, N_EXPERT))
        out.append([[0, a] for _ in range(N_LAYER)])
    return out


def _affinity_policy(cost) -> CorePolicy:
    return _policy("lru", ("affinity", {"top_n": 1.0, "min_precision": 0.5, "layer_us": 0.02}),
                   cost)


def test_affinity_plans_only_keys_that_need_a_transfer():
    """The most likely follower (expert 0, q = 1) is always resident: with top_n 1 the plan
    takes the most likely absent one (a, predicted from a at the layer before), not 0."""
    steps = _follow_stream(np.random.default_rng(2))
    results = [_replay(kind, _affinity_policy(TINY_COST), steps, 600)
               for kind in ("native", "reference")]
    (core, kinds, events, (pf_batch, pf_flat), _), ref = results
    assert np.array_equal(kinds, ref[1]) and np.array_equal(pf_flat, ref[3][1])
    # expert 0 only where it was evicted (by another layer's miss or prefetch)
    assert len(pf_flat) > 40 and (pf_flat % N_EXPERT != 0).mean() > 0.9
    used = np.zeros(len(pf_batch), dtype=bool)
    used[events[kinds == 4]] = True
    print("prefetches:", len(pf_flat), "used:", int(used.sum()))
    assert used.mean() > 0.9


def test_affinity_queues_what_the_link_carries_in_time():
    """What the link may queue is what it carries while the layer-steps before the target
    compute, on the [cost] rates: with compute far faster than the link, no transfer fits in
    time and nothing is issued."""
    fast = replace(TINY_COST, gpu_mem_gbps=1e6, cpu_mem_gbps=1e6)
    steps = _follow_stream(np.random.default_rng(2))
    for kind in ("native", "reference"):
        issued = [len(_replay(kind, _affinity_policy(cost), steps, 600)[3][1])
                  for cost in (TINY_COST, fast)]
        assert issued[0] > 40 and issued[1] == 0


def test_next_visit_learns_from_resident_experts_only():
    """A decode visit learns from the layer's resident experts (the keys eviction ranks)
    alone: with none resident the weights stay, with all resident they move. (The C core
    against this reference, residency varying: test_learned_reference.py.)"""
    from runtime.residency.reference.next_visit import W0, NextVisitModel

    def learned(resident: bool) -> list[float]:
        m = NextVisitModel(2, 16, [0, 1], 0.5)
        for t in range(16):
            for layer in (0, 1):
                m.visit(layer, [t % 16, 3], 1, [resident] * 16)
        return m.w

    assert learned(False) == list(W0)
    moved = learned(True)
    assert moved != list(W0) and all(math.isfinite(w) for w in moved)


def test_affinity_learns_from_the_prompt():
    """A prompt of 12 tokens whose layer l + 1 experts follow from layer l's (e -> e + 1),
    then decode of the same pattern: with the experts per token known (its chunks are
    token-major, 2 per token), the first decode tokens' prefetches already follow the pattern
    and are used; without, affinity knows nothing until decode taught it."""
    rng = np.random.default_rng(4)
    tokens = []
    for _ in range(24):
        first = sorted(rng.choice(N_EXPERT, 2, replace=False).tolist())
        tokens.append([[(e + d) % N_EXPERT for e in first] for d in range(N_LAYER)])
    batches = _prompt_then_decode(tokens[:12], tokens[12:], N_LAYER)
    base = _policy("lru", ("affinity", {"top_n": 2.0, "min_precision": 0.5, "layer_us": 1.0}))
    used = {}
    for k in (0, 2):
        got = [_replay_batches(kind, replace(base, n_expert_used=k), batches, 600)[1]
               for kind in ("native", "reference")]
        assert np.array_equal(got[0], got[1])
        early = sum(len(ex) for _, ex, _ in batches[:3 + 4 * N_LAYER])   # (the first 4
                                                   # decode tokens' rows)
        used[k] = int((got[0][:early] == 4).sum())
    print("prefetches used in the first 4 decode tokens, without / with the prompt's pairs:",
          used[0], used[2])
    assert used[2] >= 4 and used[2] > 2 * used[0]


def test_next_visit_wait_rolls_the_hazard_forward():
    """The wait (expected visits after the next before a key is routed again) rolls p
    forward: a key whose features do not decay (never routed) waits 1 / p - 1 = exp(-z); a
    routed key waits longer than exp(-z), its p falling as its features decay, and one routed
    once longer than one routed at every visit. (The C core against this
    reference: test_learned_reference.py.)"""
    from runtime.residency.reference.next_visit import NextVisitModel

    m = NextVisitModel(1, 4, [0], 0.0)
    m.visit(0, [1], 1, [False] * 4)              # expert 1: once; 2: every visit
    for _ in range(3):
        m.visit(0, [2], 1, [False] * 4)
    assert math.isclose(m.wait(0), math.exp(-m.logit(0)), rel_tol=1e-12)
    m.w = [-3.0, 0.0, 0.0, 0.0, 3.0]             # p from the slow EMA alone
    assert m.wait(1) > math.exp(-m.logit(1))      # it decays
    assert m.wait(2) > math.exp(-m.logit(2))
    assert m.wait(1) > m.wait(2)                   # routed once decays from lower
    m.h[2][3] = m.h[2][1]                          # expert 3: expert 1's slow EMA, the
    assert m.wait(3) == m.wait(1)                  # features the weights read: the same wait
    assert m.expected(1) == 1.0 + 1.0 * m.wait(1)  # distance 1 (its layer is next), n_moe 1


def test_affinity_neighbours_tell_apart_what_the_table_cannot():
    """16 token types: layer 0 routes each type to its own two experts, layer 1 each pair of
    types to the same two, layer 2 each type to its own again. From layer 1 alone the pair
    table can only say "one of two types" (q 0.5 each for four keys); the tokens routed like
    this one at layers 0 and 1 (neighbours.h) say which, so the plans for layer 2 are right."""
    n_layer, n_expert, k = 3, 64, 2
    rng = np.random.default_rng(11)
    types = rng.integers(0, 16, 232)
    route = [[[2 * t, 2 * t + 1], [2 * (t // 2), 2 * (t // 2) + 1], [2 * t, 2 * t + 1]]
             for t in types.tolist()]
    batches = _prompt_then_decode(route[:32], route[32:], n_layer)
    pol = replace(_policy("lru", ("affinity", {"top_n": 2.0, "min_precision": 0.2,
                                               "layer_us": 0.02})), n_expert_used=k)
    got = []
    for kind in ("native", "reference"):
        _, kinds, events, (log_b, log_f), _ = _replay_batches(
            kind, pol, batches, 800, n_layer, n_expert, [100] * n_layer)
        got.append((kinds, events, log_b, log_f))
    (k0, e0, b0, f0), (k1, e1, b1, f1) = got
    assert np.array_equal(k0, k1) and np.array_equal(b0, b1) and np.array_equal(f0, f1)
    to_layer2 = f0 // n_expert == 2
    used = np.zeros(len(f0), dtype=bool)
    used[e0[k0 == 4]] = True
    precision = used[to_layer2].mean()
    print(f"prefetches for layer 2: {int(to_layer2.sum())}, used {precision:.2f}")
    assert to_layer2.sum() >= 100 and precision >= 0.8
