"""Thinking through the Anthropic and Responses APIs on the real server, with a ChatML
template that opens ``<think>`` when thinking is on (as DeepSeek-R1's and QwQ's do): the
thinking the chat completion gives as ``reasoning_content`` comes back as a thinking block
(Anthropic; streamed with its ``signature_delta``) or a reasoning item (Responses), and
earlier thinking sent back reaches the template."""
from __future__ import annotations

import openai
import pytest

anthropic = pytest.importorskip("anthropic")   # the test extra (pyproject)

N_CTX = 1024
TEMPLATE = (
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n"
    "{% if m.reasoning_content %}<think>\n{{ m.reasoning_content }}\n</think>\n{% endif %}"
    "{{ m.content }}<|im_end|>\n{% endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is not defined or enable_thinking %}<think>\n{% endif %}"
    "{%- endif %}")
ASK = [{"role": "user", "content": "What is 2+2?"}]


@pytest.fixture(scope="module")
def server(start_server, tiny_model, tmp_path_factory):
    template = tmp_path_factory.mktemp("template") / "think.jinja"
    template.write_text(TEMPLATE)
    return start_server(tiny_model, "-c", str(N_CTX), "--temp", "0",
                        "--chat-template-file", str(template))


@pytest.fixture(scope="module")
def claude(server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.base_url, api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.api_url, api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def twin(client):
    """The chat completion's answer: its thinking (the whole answer here, the random model
    does not close it in 12 tokens) and text."""
    answer = client.chat.completions.create(model="m", messages=ASK, max_tokens=12,
                                            temperature=0)
    message = answer.choices[0].message
    thinking = message.model_extra["reasoning_content"]
    assert thinking                       # the template opened <think>
    return thinking, message.content or ""


def _blocks(message) -> list[tuple]:
    return [(b.type, getattr(b, "thinking", None) or getattr(b, "text", None))
            for b in message.content]


def test_anthropic_thinking_block(claude, twin):
    thinking, text = twin
    message = claude.messages.create(model="any", max_tokens=12, messages=ASK)
    assert _blocks(message) == [("thinking", thinking)] + ([("text", text)] if text else [])
    assert message.content[0].signature == ""
    with claude.messages.stream(model="any", max_tokens=12, messages=ASK) as stream:
        events = list(stream)
        final = stream.get_final_message()
    assert _blocks(final) == _blocks(message)
    deltas = [e.delta.type for e in events if e.type == "content_block_delta" and e.index == 0]
    assert set(deltas) == {"thinking_delta", "signature_delta"} and deltas[-1] == "signature_delta"


def test_anthropic_thinking_disabled_is_plain_text(claude, client):
    message = claude.messages.create(model="any", max_tokens=12, messages=ASK,
                                     thinking={"type": "disabled"})
    answer = client.chat.completions.create(
        model="m", messages=ASK, max_tokens=12, temperature=0,
        extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert [b.type for b in message.content] == ["text"]
    assert message.content[0].text == answer.choices[0].message.content


def test_earlier_thinking_reaches_the_template(claude):
    def count(content: list[dict]) -> int:
        return claude.messages.count_tokens(model="any", messages=[
            *ASK, {"role": "assistant", "content": content},
            {"role": "user", "content": "Sure?"}]).input_tokens
    answer = [{"type": "text", "text": "4"}]
    thought = {"type": "thinking", "thinking": "two and two make four", "signature": ""}
    assert count([thought, *answer]) > count(answer)


def test_responses_reasoning_item(client, twin):
    thinking, text = twin
    response = client.responses.create(model="any", input=ASK, max_output_tokens=12,
                                       temperature=0)
    assert response.output[0].type == "reasoning"
    assert response.output[0].content[0].text == thinking
    assert response.output_text == text
    events = list(client.responses.create(model="any", input=ASK, max_output_tokens=12,
                                          temperature=0, stream=True))
    deltas = [e.delta for e in events if e.type == "response.reasoning_text.delta"]
    assert "".join(deltas) == thinking
    assert events[-1].response.output[0].content[0].text == thinking
