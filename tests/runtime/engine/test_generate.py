"""Engine.generate behaviour the CLI and the server rely on: cancellation, one generation at a
time, context limits, KV prefix reuse, usage and timings, chat templates."""
from __future__ import annotations

import threading

import pytest

from runtime.engine.engine import Engine
from runtime.engine.sampling import SamplingParams
from runtime.engine.types import ContextLengthError, EngineBusyError

GREEDY = SamplingParams(max_tokens=16, temperature=0)


@pytest.fixture(scope="module")
def engine(tiny_model):
    from runtime.engine.types import EngineSettings

    eng = Engine(EngineSettings(model_path=str(tiny_model), n_ctx=128, n_threads=1,
                                n_threads_batch=1), progress=False)
    yield eng
    eng.close()


def test_cancel_stops_within_one_token(engine, prompt):
    cancel = threading.Event()
    chunks = []
    for chunk in engine.generate(prompt, SamplingParams(max_tokens=64, temperature=0),
                                 cancel=cancel):
        chunks.append(chunk)
        if len(chunks) == 3:
            cancel.set()
    assert chunks[-1].finish_reason == "cancelled"
    assert chunks[-1].usage.completion_tokens == 3


def test_one_generation_at_a_time(engine, prompt):
    first = engine.generate(prompt, GREEDY)
    next(first)
    with pytest.raises(EngineBusyError):
        next(engine.generate(prompt, GREEDY))
    rest = list(first)                       # the first one finishes normally
    assert rest[-1].finish_reason == "length"
    assert len(list(engine.generate(prompt, GREEDY))) == 17   # free again


def test_context_limits(engine):
    n_ctx = engine.n_ctx                      # the requested 128 (llama.cpp pads its own up)
    with pytest.raises(ContextLengthError) as info:
        engine.generate("word " * (n_ctx + 10), GREEDY)
    assert info.value.n_ctx == n_ctx and info.value.prompt_tokens >= n_ctx
    from runtime.errors import UserError
    with pytest.raises(UserError, match="outside the vocabulary"):
        engine.generate([1, engine.n_vocab], GREEDY)
    n_prompt = len(engine.tokenize("The sea"))
    chunks = list(engine.generate("The sea", SamplingParams(max_tokens=-1, temperature=0)))
    last = chunks[-1]
    assert last.finish_reason in ("length", "stop")
    if last.finish_reason == "length":        # no limit given: runs until the context is full
        assert last.usage.completion_tokens == n_ctx - n_prompt


def test_bad_ids_and_text_are_errors_at_the_engine_boundary(engine):
    """llama.cpp indexes its vocabulary unchecked (std::out_of_range through C would end the
    process) and ctypes overflows past int32: the engine refuses both as a UserError."""
    from runtime.errors import UserError
    for token in (-1, engine.n_vocab, 2**31, 2**64, True):
        with pytest.raises(UserError, match="outside the vocabulary"):
            engine.token_bytes(token)
        with pytest.raises(UserError, match="outside the vocabulary"):
            engine.detokenize([1, token])
        if token is not True:         # generate takes anything int() takes
            with pytest.raises(UserError, match="outside the vocabulary"):
                engine.generate([1, token], GREEDY)
    with pytest.raises(UserError, match="not valid Unicode"):
        engine.tokenize("a\ud800b")
    assert engine.detokenize([1, engine.n_vocab - 1]) is not None     # the edges are fine


def test_prefix_reuse_and_usage(engine, prompt):
    engine.reset()
    a = list(engine.generate(prompt, GREEDY))[-1]
    b = list(engine.generate(prompt + " again", GREEDY))[-1]
    n_prompt = len(engine.tokenize(prompt))
    assert a.usage.prompt_tokens == a.timings.prompt_tokens == n_prompt
    # the second prompt shares the first's tokens (minus the last, re-tokenized with " again")
    assert b.timings.prompt_tokens < b.usage.prompt_tokens
    assert a.timings.expert_accesses > 0 and 0 <= a.timings.hit_rate <= 1
    assert "t/s" in a.timings.summary()


def test_chat_template_from_gguf(engine):
    text = engine.chat_prompt([{"role": "system", "content": "S"},
                               {"role": "user", "content": "Hi"}])
    assert text == "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n" \
                   "<|im_start|>assistant\n"
    tokens = engine.tokenize(text)
    assert tokens.count(engine.tokenize("<|im_start|>", add_special=False)[0]) == 3
    from runtime.errors import UserError
    with pytest.raises(UserError, match="messages\\[0\\]"):
        engine.chat_prompt([{"role": "wizard", "content": "x"}])
