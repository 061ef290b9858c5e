"""The real server, driven by the official ``openai`` client: chat and text completions,
streamed and not, usage, sampling fields, stop strings, and the model list."""
from __future__ import annotations

from pathlib import Path

import openai
import pytest

ALIAS = "tiny-moe"
N_CTX = 512
PROMPT = "the king saw a river near the old house and"


@pytest.fixture(scope="module")
def server(start_server, tiny_model: Path):
    return start_server(tiny_model, "--alias", ALIAS, "-c", str(N_CTX))


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.api_url, api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def vocab(tiny_model: Path):
    """The model's tokenizer through plain llama-cpp-python (vocab only), to count tokens."""
    import llama_cpp
    from runtime.native.llama_lib import bindings
    bindings()          # AMX-safe model defaults on a stock libllama (llama_lib._guard_amx)

    return llama_cpp.Llama(str(tiny_model), vocab_only=True, verbose=False)


def _chat_prompt(messages: list[dict[str, str]]) -> str:
    # The synthetic model's template is ChatML (gguf_tools/synth_vocab.py).
    text = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
    return text + "<|im_start|>assistant\n"


def test_model_list_names_the_served_model(client: openai.OpenAI) -> None:
    models = client.models.list()
    assert [m.id for m in models.data] == [ALIAS]
    assert models.data[0].object == "model"


def test_completion_matches_plain_llama_cpp_greedy(client: openai.OpenAI, tiny_model: Path) -> None:
    import llama_cpp
    from runtime.native.llama_lib import bindings
    bindings()          # AMX-safe model defaults on a stock libllama (llama_lib._guard_amx)

    llm = llama_cpp.Llama(str(tiny_model), n_ctx=N_CTX, verbose=False)
    expected = llm.create_completion(PROMPT, max_tokens=12, temperature=0)
    got = client.completions.create(model=ALIAS, prompt=PROMPT, max_tokens=12, temperature=0)
    assert got.object == "text_completion"
    assert got.model == ALIAS
    assert got.choices[0].text == expected["choices"][0]["text"]
    assert got.choices[0].finish_reason == expected["choices"][0]["finish_reason"]
    assert got.usage.prompt_tokens == expected["usage"]["prompt_tokens"]
    assert got.usage.completion_tokens == expected["usage"]["completion_tokens"]
    assert got.usage.total_tokens == got.usage.prompt_tokens + got.usage.completion_tokens


def test_streamed_completion_equals_whole_answer(client: openai.OpenAI) -> None:
    whole = client.completions.create(model=ALIAS, prompt=PROMPT, max_tokens=16, temperature=0)
    stream = client.completions.create(model=ALIAS, prompt=PROMPT, max_tokens=16, temperature=0,
                                       stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    text_chunks = [c for c in chunks if c.choices]
    assert len(text_chunks) >= 2, "a stream sends the answer piece by piece"
    assert "".join(c.choices[0].text for c in text_chunks) == whole.choices[0].text
    assert text_chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason
    # include_usage: one last chunk with no choices carries the usage
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens
    assert all(c.usage is None for c in chunks[:-1])


def test_chat_completion_uses_the_chat_template(client: openai.OpenAI, vocab) -> None:
    messages = [{"role": "system", "content": "you are a small model"},
                {"role": "user", "content": "tell me a story about the sea"}]
    reply = client.chat.completions.create(model=ALIAS, messages=messages, max_tokens=10,
                                           temperature=0)
    assert reply.object == "chat.completion"
    choice = reply.choices[0]
    assert choice.message.role == "assistant"
    assert isinstance(choice.message.content, str)
    assert choice.finish_reason in ("stop", "length")
    assert 1 <= reply.usage.completion_tokens <= 10
    if choice.finish_reason == "length":
        assert reply.usage.completion_tokens == 10
    expected_prompt = vocab.tokenize(_chat_prompt(messages).encode(), add_bos=True, special=True)
    assert reply.usage.prompt_tokens == len(expected_prompt)


def test_streamed_chat_equals_whole_answer(client: openai.OpenAI) -> None:
    messages = [{"role": "user", "content": "what is the color of the sea"}]
    whole = client.chat.completions.create(model=ALIAS, messages=messages, max_tokens=16,
                                           temperature=0)
    chunks = list(client.chat.completions.create(model=ALIAS, messages=messages, max_tokens=16,
                                                 temperature=0, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert len({c.id for c in chunks}) == 1
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert text == whole.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason
    assert all(c.usage is None for c in chunks), "no usage chunk unless include_usage"


def test_seed_makes_sampling_repeatable(client: openai.OpenAI) -> None:
    kwargs = dict(model=ALIAS, prompt=PROMPT, max_tokens=24, temperature=1.0, top_p=1.0)
    first = client.completions.create(seed=1234, **kwargs).choices[0].text
    again = client.completions.create(seed=1234, **kwargs).choices[0].text
    assert first == again
    others = {client.completions.create(seed=s, **kwargs).choices[0].text for s in (1, 2, 3)}
    assert len(others | {first}) > 1, "different seeds should not all sample the same text"


def test_stop_string_ends_the_answer_before_it(client: openai.OpenAI) -> None:
    full = client.completions.create(model=ALIAS, prompt=PROMPT, max_tokens=24,
                                     temperature=0).choices[0].text
    assert len(full) > 8, f"need a longer greedy answer to cut: {full!r}"
    stop = full[len(full) // 2: len(full) // 2 + 3]
    cut = client.completions.create(model=ALIAS, prompt=PROMPT, max_tokens=24, temperature=0,
                                    stop=[stop])
    assert cut.choices[0].text == full[: full.index(stop)]
    assert cut.choices[0].finish_reason == "stop"


def test_max_tokens_bounds_the_answer(client: openai.OpenAI) -> None:
    reply = client.completions.create(model=ALIAS, prompt=PROMPT, max_tokens=3, temperature=0)
    assert reply.usage.completion_tokens <= 3
    assert reply.choices[0].finish_reason in ("length", "stop")
    if reply.choices[0].finish_reason == "length":
        assert reply.usage.completion_tokens == 3


