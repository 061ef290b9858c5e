"""The Anthropic Messages API (``/v1/messages``) through the official ``anthropic`` client,
unchanged, against the real server: a translation of the chat-completion path, so with greedy
sampling its text and token counts are those of the equivalent chat completion; tools come
back as ``tool_use`` blocks (the grammar forces the call) and go back as ``tool_result``;
errors are in Anthropic's shape."""
from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest

anthropic = pytest.importorskip("anthropic")   # the test extra (pyproject)

from tests.runtime.server.api_fixtures import N_CTX, SYSTEM, TURNS, WEATHER_SCHEMA

WEATHER = {"name": "get_weather", "description": "Weather of a city",
           "input_schema": WEATHER_SCHEMA}
FORCE_WEATHER = {"type": "tool", "name": "get_weather"}


@pytest.fixture(scope="module")
def server(start_server, tiny_model):
    # greedy by default: the newest anthropic client has no temperature
    return start_server(tiny_model, "-c", str(N_CTX), "--temp", "0")


@pytest.fixture(scope="module")
def client(server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.base_url, api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def chat(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.api_url, api_key="unused", max_retries=0)


def _chat_twin(chat: openai.OpenAI, messages: list[dict], **kw):
    return chat.chat.completions.create(model="m", messages=messages, **kw)


def _input_tokens(usage) -> int:
    return usage.input_tokens + (usage.cache_read_input_tokens or 0)


def test_plain_message_equals_the_greedy_chat_completion(client, chat):
    message = client.messages.create(model="any", max_tokens=24, system=SYSTEM,
                                     messages=TURNS)
    twin = _chat_twin(chat, [{"role": "system", "content": SYSTEM}, *TURNS], max_tokens=24)
    assert message.type == "message" and message.role == "assistant"
    assert message.id.startswith("msg_")
    text = "".join(b.text for b in message.content if b.type == "text")
    assert [b.type for b in message.content] == (["text"] if text else [])
    assert text == twin.choices[0].message.content
    assert message.stop_reason == {"length": "max_tokens", "stop": "end_turn"}[
        twin.choices[0].finish_reason]
    assert message.stop_sequence is None
    assert _input_tokens(message.usage) == twin.usage.prompt_tokens
    assert message.usage.output_tokens == twin.usage.completion_tokens > 0


def test_streamed_message_equals_the_whole_one(client):
    kw = {"model": "any", "max_tokens": 24, "system": SYSTEM,
          "messages": TURNS}
    whole = client.messages.create(**kw)
    with client.messages.stream(**kw) as stream:
        streamed = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert streamed == "".join(b.text for b in whole.content if b.type == "text")
    assert [(b.type, b.text) for b in final.content] == [(b.type, b.text) for b in whole.content]
    assert final.stop_reason == whole.stop_reason
    assert final.usage.output_tokens == whole.usage.output_tokens
    assert _input_tokens(final.usage) == _input_tokens(whole.usage)


def test_stream_events_come_in_anthropics_order(client):
    events = list(client.messages.create(model="any", max_tokens=12,
                                         messages=TURNS, stream=True))
    kinds = [e.type for e in events]
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    start = events[0].message
    assert start.content == [] and start.usage.input_tokens > 0 and start.stop_reason is None
    assert kinds[1:-2] == ["content_block_start", *["content_block_delta"] * (len(kinds) - 5),
                           "content_block_stop"]
    assert events[1].index == 0 and events[1].content_block.type == "text"
    assert all(e.delta.type == "text_delta" for e in events[2:-3])
    assert events[-2].delta.stop_reason in ("end_turn", "max_tokens")
    assert events[-2].usage.output_tokens == 12 or events[-2].delta.stop_reason == "end_turn"


def test_forced_tool_gives_a_tool_use_block_then_takes_the_result(client, chat):
    message = client.messages.create(
        model="any", max_tokens=200, tools=[WEATHER], tool_choice=FORCE_WEATHER,
        messages=[{"role": "user", "content": "Weather in Paris?"}])
    assert message.stop_reason == "tool_use"
    call = message.content[-1]
    assert call.type == "tool_use" and call.name == "get_weather" and call.id
    jsonschema.validate(call.input, WEATHER_SCHEMA)
    # the follow-up turn: the call's result, answered as the chat completion answers it
    follow = [{"role": "user", "content": "Weather in Paris?"},
              {"role": "assistant", "content": message.content},   # as Anthropic's docs do
              {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id,
                                            "content": "Sunny, 25 C"}]}]
    answer = client.messages.create(model="any", max_tokens=16,
                                    tools=[WEATHER], messages=follow)
    twin = _chat_twin(chat, [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [{
            "id": call.id, "type": "function",
            "function": {"name": "get_weather", "arguments": json.dumps(call.input)}}]},
        {"role": "tool", "tool_call_id": call.id, "content": "Sunny, 25 C"}],
        max_tokens=16, tools=[{"type": "function", "function": {
            "name": "get_weather", "description": "Weather of a city",
            "parameters": WEATHER_SCHEMA}}])
    assert _input_tokens(answer.usage) == twin.usage.prompt_tokens
    assert answer.usage.output_tokens == twin.usage.completion_tokens
    text = "".join(b.text for b in answer.content if b.type == "text")
    assert text == (twin.choices[0].message.content or "")


def test_streamed_tool_use_accumulates_its_input(client):
    with client.messages.stream(model="any", max_tokens=200, tools=[WEATHER],
                                tool_choice={"type": "any"},
                                messages=[{"role": "user", "content": "Weather?"}]) as stream:
        events = list(stream)
        final = stream.get_final_message()
    starts = [e for e in events if e.type == "content_block_start"]
    assert [e.index for e in starts] == list(range(len(starts)))
    assert starts[-1].content_block.type == "tool_use"
    assert final.stop_reason == "tool_use" and final.content[-1].name == "get_weather"
    jsonschema.validate(final.content[-1].input, WEATHER_SCHEMA)


def test_output_config_format_constrains_the_answer(client):
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    message = client.messages.create(
        model="any", max_tokens=40, messages=[{"role": "user", "content": "A number."}],
        output_config={"format": {"type": "json_schema", "schema": schema}})
    jsonschema.validate(json.loads(message.content[0].text), schema)


def test_count_tokens_equals_the_chat_prompt(client, server):
    counted = client.messages.count_tokens(model="any", system=SYSTEM, messages=TURNS)
    chat_count = httpx.post(f"{server.api_url}/chat/completions/input_tokens", json={
        "messages": [{"role": "system", "content": SYSTEM}, *TURNS]}).json()
    assert counted.input_tokens == chat_count["input_tokens"] > 0
    whole_request = httpx.post(f"{server.base_url}/v1/messages/count_tokens", json={
        "system": SYSTEM, "messages": TURNS, "max_tokens": 8, "stream": True}).json()
    assert whole_request == {"input_tokens": counted.input_tokens}


def test_bad_input_is_400_in_anthropics_shape(client, server):
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": "AAAA"}}
    with pytest.raises(anthropic.BadRequestError) as err:
        client.messages.create(model="any", max_tokens=8, messages=[
            {"role": "user", "content": [image, {"type": "text", "text": "What is this?"}]}])
    assert err.value.status_code == 400
    assert err.value.body["type"] == "error"
    assert err.value.body["error"]["type"] == "invalid_request_error"
    assert "multimodal projector" in err.value.body["error"]["message"]
    with pytest.raises(anthropic.BadRequestError) as err:      # refused before it streams
        client.messages.create(model="any", max_tokens=8, stream=True, messages=[
            {"role": "user", "content": "word " * N_CTX}])
    assert err.value.body["type"] == "error" and "context" in err.value.body["error"]["message"]
    for body in ({"max_tokens": 8, "messages": [{"role": "robot", "content": "hi"}]},
                 {"max_tokens": 8, "messages": TURNS, "frobnicate": 1},
                 {"max_tokens": 8, "messages": TURNS, "tool_choice": {"type": "any"}},
                 {"max_tokens": 8, "messages": TURNS,
                  "tools": [{"type": "web_search_20250305", "name": "web_search"}]}):
        r = httpx.post(f"{server.base_url}/v1/messages", json=body)
        assert r.status_code == 400, (body, r.text)
        assert r.json()["type"] == "error" and set(r.json()["error"]) == {"type", "message"}


def test_the_clients_api_key_header_and_a_401_in_anthropics_shape(start_server, tiny_model):
    server = start_server(tiny_model, "-c", "512", "--api-key", "sk-ant-test")
    good = anthropic.Anthropic(base_url=server.base_url, api_key="sk-ant-test", max_retries=0)
    assert good.messages.create(model="any", max_tokens=2, messages=TURNS).usage.output_tokens
    bad = anthropic.Anthropic(base_url=server.base_url, api_key="sk-wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as err:
        bad.messages.create(model="any", max_tokens=2, messages=TURNS)
    assert err.value.body == {"type": "error", "error": {
        "type": "authentication_error", "message": "Incorrect API key provided."}}
