"""``serve -np 4``: what parallel slots guarantee, and nothing more.

Four clients streaming at once are served at once (continuous batching), not queued: every
stream has its first token before any stream has its last. Each answer is the request's own
(its own KV and sampler), but llama.cpp evaluates a batch of several sequences in another
order than one sequence alone, so a greedy answer equals the same request alone until a step
where its two best tokens nearly tie, and may part there (runtime/engine/batched.py).
``--batch-invariant`` decodes each request shaped as alone: the answers are then equal.
Speed is measured by scripts/bench_parallel.py, not here.
"""
from __future__ import annotations

import threading

import openai
import pytest

from gguf_tools.synth import SynthSpec
from tests.runtime.server.test_serve_command import _assert_one_line_error, _serve

SPEC = SynthSpec(arch="qwen3moe", layers=8, experts=16, top_k=2, embd=256, ff=256,
                 dtype="q8_0", seed=5, skew=1.0)
PROMPTS = ["Once upon a time", "The king saw a river", "hello world", "In the morning the sun"]
N_TOKENS = 96
# nats: a batched row's logprobs differ from the lone row's by at most about 0.01 (measured,
# per-slot KV); a greedy answer may part from the lone one only where its two best tokens are
# closer than that
NEAR_TIE = 0.1


@pytest.fixture(scope="module")
def model(synth_model_factory):
    return synth_model_factory(SPEC)


def _client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.api_url, api_key="x", max_retries=0, timeout=300)


def _alone(client) -> list[tuple[list[str], list[dict]]]:
    """Each prompt's greedy tokens and top-2 logprobs, one request after another."""
    out = []
    for prompt in PROMPTS:
        lp = client.completions.create(model="m", prompt=prompt, max_tokens=N_TOKENS,
                                       temperature=0, logprobs=2).choices[0].logprobs
        out.append((lp.tokens, lp.top_logprobs))
    return out


def _at_once(client) -> tuple[list[tuple[list[str], list[dict]]], list[tuple[str, int]]]:
    """The four prompts streamed at once: each one's tokens and top-2 logprobs, and the order
    in which the streams' first and last tokens arrived."""
    results: list = [None] * len(PROMPTS)
    order: list[tuple[str, int]] = []
    lock = threading.Lock()
    start = threading.Barrier(len(PROMPTS))

    def stream(i: int) -> None:
        tokens, tops = [], []
        start.wait()
        for chunk in client.completions.create(model="m", prompt=PROMPTS[i],
                                               max_tokens=N_TOKENS, temperature=0, logprobs=2,
                                               stream=True):
            lp = chunk.choices[0].logprobs if chunk.choices else None
            if lp and lp.tokens:
                if not tokens:
                    with lock:
                        order.append(("first", i))
                tokens += lp.tokens
                tops += lp.top_logprobs
        with lock:
            order.append(("last", i))
        results[i] = (tokens, tops)

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(len(PROMPTS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results, order


def _served_at_once(order: list[tuple[str, int]]) -> None:
    """Queued, the last stream's first token would come after the others' whole answers."""
    firsts = [k for k, (what, _) in enumerate(order) if what == "first"]
    lasts = [k for k, (what, _) in enumerate(order) if what == "last"]
    assert len(firsts) == len(PROMPTS) and max(firsts) < min(lasts), order


def test_four_streams_at_once_are_batched_and_part_from_alone_only_at_a_near_tie(
        start_server, model):
    server = start_server(model, "-np", "4", "-c", "4096", "-t", "1")
    client = _client(server)
    alone = _alone(client)
    together, order = _at_once(client)
    _served_at_once(order)
    for i, ((tokens, tops), (lone_tokens, lone_tops)) in enumerate(zip(together, alone)):
        same = next((k for k, (a, b) in enumerate(zip(tokens, lone_tokens)) if a != b),
                    min(len(tokens), len(lone_tokens)))       # tokens equal before this one
        for k in range(same):
            assert abs(tops[k][tokens[k]] - lone_tops[k][tokens[k]]) < NEAR_TIE, (i, k)
        if same < max(len(tokens), len(lone_tokens)):       # parted (or one ended): a near-tie
            top = (lone_tops if same < len(lone_tokens) else tops)[same]
            best = sorted(top.values(), reverse=True)
            assert best[0] - best[1] < NEAR_TIE, (i, same, top)


def test_batch_invariant_slots_answer_exactly_as_alone(start_server, model):
    server = start_server(model, "-np", "4", "-c", "4096", "-t", "1", "--batch-invariant")
    client = _client(server)
    alone = _alone(client)
    together, order = _at_once(client)
    _served_at_once(order)
    for i, ((tokens, tops), (lone_tokens, lone_tops)) in enumerate(zip(together, alone)):
        assert tokens == lone_tokens, i
        assert tops == lone_tops, i                          # bit for bit


def test_batch_invariant_needs_a_kv_per_slot(tiny_model):
    _assert_one_line_error(_serve("-m", str(tiny_model), "--port", "0", "-np", "2",
                                  "--kv-unified", "--batch-invariant"), "--kv-unified")


def test_n_choices_decode_side_by_side(start_server, model):
    server = start_server(model, "-np", "2", "-c", "2048", "-t", "1")
    r = _client(server).chat.completions.create(
        model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=12, n=2,
        temperature=0)
    assert len(r.choices) == 2
    assert r.choices[0].message.content == r.choices[1].message.content
    slots = __import__("httpx").get(f"{server.base_url}/slots").json()
    assert len(slots) == 2 and all(s["n_ctx"] == 1024 for s in slots)
