"""Sampling: the sampler chain matches llama-cpp-python's draw for draw with a seed, the
parameters are validated, and stop strings / UTF-8 are handled on the text stream."""
from __future__ import annotations

import itertools

import pytest
from hypothesis import given, strategies as st

from runtime.engine.engine import Engine
from runtime.engine.sampling import SamplingParams, TextStream
from runtime.errors import UserError


@pytest.mark.parametrize("kw", [
    dict(temperature=0.8, seed=42),
    dict(temperature=1.5, top_k=0, top_p=0.9, min_p=0.0, seed=7),
    dict(temperature=0.7, repeat_penalty=1.3, seed=3),
], ids=["defaults", "top-p-only", "repeat-penalty"])
def test_seeded_sampling_matches_llama_cpp_python(tiny_model, make_settings, prompt, kw):
    import llama_cpp
    from runtime.native.llama_lib import bindings
    bindings()          # AMX-safe model defaults on a stock libllama (llama_lib._guard_amx)

    n = 40
    llm = llama_cpp.Llama(model_path=str(tiny_model), n_ctx=512, verbose=False, seed=kw["seed"])
    try:
        tokens = llm.tokenize(prompt.encode(), add_bos=True, special=True)
        want = list(itertools.islice(llm.generate(
            tokens, temp=kw["temperature"], top_k=kw.get("top_k", 40),
            top_p=kw.get("top_p", 0.95), min_p=kw.get("min_p", 0.05),
            repeat_penalty=kw.get("repeat_penalty", 1.0)), n))
    finally:
        llm.close()
    with Engine(make_settings(tiny_model), progress=False) as engine:
        chunks = engine.generate(tokens, SamplingParams(max_tokens=n, **kw))
        got = [c.token for c in chunks if c.token is not None]
    assert got == want


@pytest.mark.parametrize("bad", [dict(temperature=-0.1), dict(top_p=0.0), dict(top_k=-1),
                                 dict(min_p=1.5), dict(repeat_penalty=0.0)])
def test_invalid_parameters_are_user_errors(bad):
    with pytest.raises(UserError, match="sampling:"):
        SamplingParams(**bad)


def _run(stream: TextStream, pieces: list[bytes]) -> str:
    return "".join(stream.feed(p) for p in pieces) + stream.finish()


def test_stop_string_split_across_tokens_is_never_shown():
    s = TextStream(["END"])
    shown = [s.feed(p) for p in [b"abc E", b"N", b"D tail"]]
    assert shown == ["abc ", "", ""] and s.stopped and s.finish() == ""


def test_partial_stop_prefix_is_released_when_it_breaks():
    s = TextStream(["END"])
    assert s.feed(b"xx EN") == "xx "
    assert s.feed(b"O") == "ENO"


def test_multibyte_utf8_across_tokens():
    s = TextStream([])
    euro = "€".encode()          # 3 bytes
    assert s.feed(euro[:1]) == "" and s.feed(euro[1:2]) == ""
    assert s.feed(euro[2:] + b"!") == "€!"


@given(st.text(max_size=40), st.lists(st.integers(1, 6), max_size=20),
       st.lists(st.text(min_size=1, max_size=4), max_size=3))
def test_stream_equals_batch_reference(text, cuts, stops):
    """Whatever the token boundaries, the shown text equals the reference: after each token,
    if the text so far contains a stop string, everything before the earliest one (and
    generation ends there, as in llama-cpp-python); nothing past a stop is ever shown."""
    data = text.encode()
    pieces, i = [], 0
    for c in cuts:
        pieces.append(data[i:i + c])
        i += c
    pieces.append(data[i:])
    want = text
    for n in range(1, len(pieces) + 1):
        so_far = b"".join(pieces[:n]).decode("utf-8", errors="ignore")
        found = [so_far.find(s) for s in stops if s in so_far]
        if found:
            want = so_far[:min(found)]
            break
    assert _run(TextStream(stops), pieces) == want
