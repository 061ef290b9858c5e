"""Synthetic traces: execution order, valid routing, and knobs that do what they say."""
from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from runtime.traces.synthetic import SynthTraceSpec, synthesize
from runtime.traces.trace import PHASE_DECODE, PHASE_PREFILL


@settings(max_examples=25, deadline=None, derandomize=True)
@given(n_layer=st.integers(1, 5), n_expert=st.integers(1, 40), data=st.data(),
       prompt=st.integers(0, 9), decode=st.integers(0, 6), chunk=st.integers(1, 5),
       skew=st.floats(0, 3), reuse=st.floats(0, 1), seed=st.integers(0, 5))
def test_any_shape_routes_validly(n_layer, n_expert, data, prompt, decode, chunk, skew, reuse,
                                  seed):
    k = data.draw(st.integers(1, n_expert))
    if prompt + decode == 0:
        decode = 1
    spec = SynthTraceSpec(n_layer=n_layer, n_expert=n_expert, top_k=k, prompt_tokens=prompt,
                          decode_tokens=decode, chunk=chunk, skew=skew, reuse=reuse, seed=seed)
    t = synthesize(spec)
    t.validate(lambda i: f"row {i}")
    assert len(t) == (prompt + decode) * n_layer * k
    # every (step, layer) routes k distinct experts, slots 0..k-1 by descending weight
    order = np.lexsort((t.slot, t.layer, t.step))
    ex = t.expert[order].reshape(-1, k)
    assert all(len(set(row)) == k for row in ex.tolist())
    assert (t.slot[order].reshape(-1, k) == np.arange(k)).all()
    w = t.weight[order].reshape(-1, k)
    assert (np.diff(w, axis=1) <= 1e-7).all()
    np.testing.assert_allclose(w.sum(axis=1), 1.0, rtol=1e-5)
    # execution order: ceil(prompt / chunk) chunks of n_layer batches, then n_layer per step
    # (a single-layer model's chunks follow each other with nothing between: one batch)
    chunks = -(-prompt // chunk) if n_layer > 1 else min(prompt, 1)
    n_batches = chunks * n_layer + decode * n_layer
    assert len(t.batch_bounds()) - 1 == n_batches
    assert (t.phase[: prompt * n_layer * k] == PHASE_PREFILL).all()
    assert (t.phase[prompt * n_layer * k:] == PHASE_DECODE).all()
    assert t.token_count(PHASE_DECODE) == decode


def test_rows_follow_the_readme_order():
    t = synthesize(SynthTraceSpec(n_layer=2, n_expert=8, top_k=2, prompt_tokens=3,
                                  decode_tokens=2, chunk=2))
    blocks = list(zip(t.phase.tolist(), t.layer.tolist(), t.step.tolist()))[::2]
    assert blocks == [(0, 0, 0), (0, 0, 1), (0, 1, 0), (0, 1, 1),   # chunk 1: layer by layer
                      (0, 0, 2), (0, 1, 2),                         # chunk 2
                      (1, 0, 3), (1, 1, 3), (1, 0, 4), (1, 1, 4)]   # decode: step by step


def test_same_seed_same_trace_other_seed_differs():
    spec = SynthTraceSpec(n_layer=3, n_expert=16, top_k=2, prompt_tokens=8, decode_tokens=8)
    a, b = synthesize(spec), synthesize(spec)
    c = synthesize(SynthTraceSpec(**{**spec.__dict__, "seed": 1}))
    assert np.array_equal(a.expert, b.expert) and np.array_equal(a.weight, b.weight)
    assert not np.array_equal(a.expert, c.expert)


def _decode_matrix(t, k):
    m = t.phase == PHASE_DECODE
    return t.expert[m].reshape(-1, t.header.n_layer, k)   # (steps, layers, k)


def test_skew_concentrates_routing():
    def top_share(skew):
        t = synthesize(SynthTraceSpec(n_layer=4, n_expert=64, top_k=4, prompt_tokens=0,
                                      decode_tokens=300, skew=skew, reuse=0.0))
        counts = np.bincount(t.keys(), minlength=4 * 64).reshape(4, 64)
        top8 = np.sort(counts, axis=1)[:, -8:].sum()
        return top8 / counts.sum()
    flat, skewed = top_share(0.0), top_share(1.5)
    assert flat < 0.2 < 0.5 < skewed  # uniform: 8/64 = 0.125


def test_reuse_makes_consecutive_tokens_share_experts():
    def overlap(reuse):
        t = synthesize(SynthTraceSpec(n_layer=4, n_expert=64, top_k=4, prompt_tokens=0,
                                      decode_tokens=300, skew=0.0, reuse=reuse))
        ex = _decode_matrix(t, 4)
        shared = [len(set(a) & set(b)) for a, b in zip(ex[:-1].reshape(-1, 4).tolist(),
                                                      ex[1:].reshape(-1, 4).tolist())]
        return np.mean(shared) / 4
    none, much = overlap(0.0), overlap(0.8)
    assert none < 0.15 and much > 0.6
