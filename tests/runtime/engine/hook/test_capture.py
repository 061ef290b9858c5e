"""Routing capture against llama.cpp itself: the expert ids the hook reports are the top-k of
``ffn_moe_probs-<layer>`` read from the same graph, for every prompt token of every MoE layer
(also across ubatches), and generated tokens are tagged decode."""
from __future__ import annotations

import numpy as np
import pytest

from runtime.engine import engine as engine_module
from runtime.engine.engine import Engine
from runtime.engine.hook.c_hook import CHook
from runtime.engine.hook.reference import RoutingHook
from runtime.engine.sampling import SamplingParams
from runtime.residency.types import Phase


class Collect:
    def __init__(self):
        self.events = []
        self.batches = []

    def on_route(self, event):
        self.events.append(event)

    def on_batch_end(self, phase, n_tokens):
        self.batches.append((phase, n_tokens))


def _capture(make_settings, model, prompt, n_predict=6, **kw):
    engine = Engine(make_settings(model, manage_residency=False, capture_all_tokens=True, **kw),
                    progress=False)
    probs = []          # (layer, (n_tokens, n_expert) probs) in graph order
    for layer in engine.facts.moe_layers:
        engine.hook.watch(f"ffn_moe_probs-{layer}",
                          lambda name, data: probs.append(
                              (int(name.rsplit("-", 1)[1]), data.reshape(-1, data.shape[-1]))))
    seen = Collect()
    engine.add_route_observer(seen)
    n_prompt = len(engine.tokenize(prompt))
    chunks = list(engine.generate(prompt, SamplingParams(max_tokens=n_predict, temperature=0)))
    facts = engine.facts
    engine.close()
    return facts, n_prompt, chunks, seen, probs


@pytest.mark.parametrize("batching", [{}, {"n_batch": 64, "n_ubatch": 4}],
                         ids=["one-ubatch", "ubatch-4"])
def test_capture_equals_topk_of_router_probs(tiny_model, make_settings, prompt, batching):
    facts, n_prompt, chunks, seen, probs = _capture(make_settings, tiny_model, prompt,
                                                    **batching)
    k = facts.n_expert_used
    assert len(seen.events) == len(probs) > 0
    max_diff = 0.0
    for event, (layer, p) in zip(seen.events, probs):
        assert event.layer == layer
        assert event.experts.shape == (p.shape[0], k)
        # llama.cpp's argsort_top_k: descending probability
        want = np.argsort(-p, axis=1, kind="stable")[:, :k]
        np.testing.assert_array_equal(event.experts, want)
        # the applied weights are the selected probs renormalised (qwen3moe: norm_w)
        sel = np.take_along_axis(p, want, axis=1)
        ref = sel / sel.sum(axis=1, keepdims=True)
        max_diff = max(max_diff, float(np.abs(event.weights - ref).max()))
    assert max_diff < 1e-5, f"weights differ from renormalised router probs by {max_diff}"
    print(f"max |weight - reference| = {max_diff:.2e}")


@pytest.mark.parametrize("batching", [{}, {"n_batch": 64, "n_ubatch": 4}],
                         ids=["one-ubatch", "ubatch-4"])
def test_every_prompt_token_of_every_layer_and_decode_tags(tiny_model, make_settings, prompt,
                                                          batching):
    facts, n_prompt, chunks, seen, _ = _capture(make_settings, tiny_model, prompt, n_predict=6,
                                                **batching)
    ubatch = batching.get("n_ubatch", 512)
    n_generated = chunks[-1].usage.completion_tokens
    assert n_generated == 6
    for layer in facts.moe_layers:
        pre = [e for e in seen.events if e.layer == layer and e.phase == Phase.PREFILL]
        assert len(pre) == -(-n_prompt // ubatch)      # one event per ubatch
        steps = np.concatenate([e.first_step + np.arange(e.n_tokens) for e in pre])
        np.testing.assert_array_equal(steps, np.arange(n_prompt))
        dec = [e for e in seen.events if e.layer == layer and e.phase == Phase.DECODE]
        # the last sampled token is never decoded: n_generated - 1 decode steps
        assert [e.first_step for e in dec] == list(range(n_prompt, n_prompt + n_generated - 1))
        assert all(e.n_tokens == 1 for e in dec)
    assert seen.batches[0] == (Phase.PREFILL, n_prompt)
    assert all(b == (Phase.DECODE, 1) for b in seen.batches[1:])
    assert {e.turn for e in seen.events} == {0}


class CollectAtBatchEnd(Collect):
    synchronous = False        # the C hook hands the events over at the batch's end


def _events(make_settings, model, prompt, observer, monkeypatch=None, **kw):
    if monkeypatch is not None:                 # the slow reference: Python's cb_eval
        monkeypatch.setattr(engine_module, "CHook", RoutingHook)   # built from the same config
    engine = Engine(make_settings(model, n_batch=64, n_ubatch=4, **kw), progress=False)
    if monkeypatch is not None:
        monkeypatch.undo()
    engine.add_route_observer(observer)
    hook = type(engine.hook)
    for text in (prompt, prompt + " and more"):      # the second call reuses the KV prefix
        list(engine.generate(text, SamplingParams(max_tokens=10, temperature=0)))
    snap = engine.manager.snapshot() if engine.manager is not None else None
    engine.close()
    return hook, observer, snap


@pytest.mark.parametrize("recording", [True, False])
@pytest.mark.parametrize("observer", [CollectAtBatchEnd, Collect],
                         ids=["at-batch-end", "synchronous"])
def test_c_hook_equals_the_python_hook(tiny_model, make_settings, prompt, recording,
                                            observer, monkeypatch):
    """The C hook (framing, the manager fed from C, the events handed over at the batch's end
    or through the observer adapter as they happen) against its reference, RoutingHook over
    RouteAssembler: the same events, batches and residency counters, recording or live."""
    kw = dict(manage_residency=False, capture_all_tokens=True) if recording else {}
    fast_hook, fast, fast_snap = _events(make_settings, tiny_model, prompt, observer(), **kw)
    slow_hook, slow, slow_snap = _events(make_settings, tiny_model, prompt, Collect(),
                                         monkeypatch, **kw)
    assert fast_hook is CHook and slow_hook is RoutingHook
    assert len(fast.events) == len(slow.events) > 0
    for a, b in zip(fast.events, slow.events):
        assert (a.layer, a.phase, a.first_step, a.turn) == (b.layer, b.phase, b.first_step, b.turn)
        np.testing.assert_array_equal(a.experts, b.experts)
        np.testing.assert_array_equal(a.weights, b.weights)
    assert fast.batches == slow.batches
    assert {e.turn for e in fast.events} == {0, 1}
    if not recording:        # the same decisions (capacity: 50% of the RAM free at each load)
        for a, b in zip(fast_snap.devices, slow_snap.devices):
            assert (a.phases, a.resident_bytes, a.resident_experts) == \
                (b.phases, b.resident_bytes, b.resident_experts)
        assert fast_snap.device("cpu").total.accesses == sum(e.experts.size for e in fast.events)


def test_live_mode_last_layer_routes_only_the_output_token(tiny_model, make_settings, prompt):
    """Without recording, llama.cpp computes the last layer only for the token whose logits
    it outputs; the hook reports exactly that (the manager sees what really runs)."""
    with Engine(make_settings(tiny_model, n_batch=64, n_ubatch=4), progress=False) as engine:
        seen = Collect()
        engine.add_route_observer(seen)
        tokens = engine.tokenize(prompt + " jumps over the dog")
        list(engine.generate(tokens, SamplingParams(max_tokens=2, temperature=0)))
        last = engine.facts.n_layer - 1
        pre = [e for e in seen.events if e.phase == Phase.PREFILL]
        assert [(e.first_step, e.n_tokens) for e in pre if e.layer == last] == \
            [(len(tokens) - 1, 1)]
        for layer in engine.facts.moe_layers[:-1]:
            rows = sum(e.n_tokens for e in pre if e.layer == layer)
            assert rows == len(tokens)
        assert engine.manager.snapshot().device("cpu").total.accesses == \
            sum(e.experts.size for e in seen.events)
