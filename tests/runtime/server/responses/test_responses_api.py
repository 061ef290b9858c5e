"""The OpenAI Responses API (``/v1/responses``) through the official ``openai`` client,
unchanged, against the real server: a translation of the chat-completion path, so with greedy
sampling its text and token counts are those of the equivalent chat completion; function tools
come back as ``function_call`` items and go back as ``function_call_output``."""
from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest

from tests.runtime.server.api_fixtures import N_CTX, TURNS, WEATHER_SCHEMA
from tests.runtime.server.api_fixtures import SYSTEM as INSTRUCTIONS

WEATHER = {"type": "function", "name": "get_weather", "description": "Weather of a city",
           "parameters": WEATHER_SCHEMA}
CHAT_WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city", "parameters": WEATHER_SCHEMA}}


@pytest.fixture(scope="module")
def server(start_server, tiny_model):
    return start_server(tiny_model, "-c", str(N_CTX))


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.api_url, api_key="unused", max_retries=0)


def _chat_twin(client: openai.OpenAI, messages: list[dict], **kw):
    return client.chat.completions.create(model="m", messages=messages, temperature=0, **kw)


def test_plain_response_equals_the_greedy_chat_completion(client):
    response = client.responses.create(model="any", instructions=INSTRUCTIONS, input=TURNS,
                                       max_output_tokens=24, temperature=0)
    twin = _chat_twin(client, [{"role": "system", "content": INSTRUCTIONS}, *TURNS],
                      max_tokens=24)
    assert response.id.startswith("resp_") and response.object == "response"
    assert [item.type for item in response.output] == ["message"]
    assert response.output[0].id.startswith("msg_")
    assert response.output_text == twin.choices[0].message.content
    assert response.status == {"length": "incomplete", "stop": "completed"}[
        twin.choices[0].finish_reason]
    assert response.usage.input_tokens == twin.usage.prompt_tokens
    assert response.usage.output_tokens == twin.usage.completion_tokens > 0
    assert response.usage.total_tokens == twin.usage.total_tokens
    # a string input is one user message
    one = client.responses.create(model="any", input="Hello", max_output_tokens=8,
                                  temperature=0)
    twin = _chat_twin(client, [{"role": "user", "content": "Hello"}], max_tokens=8)
    assert one.output_text == twin.choices[0].message.content


def test_streamed_response_equals_the_whole_one(client):
    kw = {"model": "any", "instructions": INSTRUCTIONS, "input": TURNS,
          "max_output_tokens": 24, "temperature": 0}
    whole = client.responses.create(**kw)
    events = list(client.responses.create(stream=True, **kw))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", "response.completed"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    item_id = events[2].item.id
    assert item_id.startswith("msg_")
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert all(e.item_id == item_id for e in deltas)
    completed = events[-1].response
    assert "".join(e.delta for e in deltas) == completed.output_text == whole.output_text
    assert completed.id == events[0].response.id
    assert completed.usage.output_tokens == whole.usage.output_tokens
    assert completed.usage.input_tokens == whole.usage.input_tokens


def test_function_tool_gives_a_function_call_then_takes_its_output(client):
    response = client.responses.create(
        model="any", input="Weather in Paris?", tools=[WEATHER], temperature=0,
        tool_choice={"type": "function", "name": "get_weather"}, max_output_tokens=200)
    call = response.output[-1]
    assert call.type == "function_call" and call.name == "get_weather"
    assert call.id.startswith("fc_") and call.call_id
    jsonschema.validate(json.loads(call.arguments), WEATHER_SCHEMA)
    follow = [{"role": "user", "content": "Weather in Paris?"},
              {"type": "function_call", "call_id": call.call_id, "name": call.name,
               "arguments": call.arguments},
              {"type": "function_call_output", "call_id": call.call_id,
               "output": "Sunny, 25 C"}]
    answer = client.responses.create(model="any", input=follow, tools=[WEATHER],
                                     temperature=0, max_output_tokens=16)
    twin = _chat_twin(client, [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [{
            "id": call.call_id, "type": "function",
            "function": {"name": call.name, "arguments": call.arguments}}]},
        {"role": "tool", "tool_call_id": call.call_id, "content": "Sunny, 25 C"}],
        tools=[CHAT_WEATHER], max_tokens=16)
    assert answer.usage.input_tokens == twin.usage.prompt_tokens
    assert answer.output_text == (twin.choices[0].message.content or "")


def test_streamed_function_call(client):
    events = list(client.responses.create(
        model="any", input="Weather?", tools=[WEATHER], tool_choice="required",
        temperature=0, max_output_tokens=200, stream=True))
    added = [e for e in events if e.type == "response.output_item.added"]
    assert added[-1].item.type == "function_call" and added[-1].item.name == "get_weather"
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    deltas = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    assert "".join(deltas) == done.arguments and done.item_id == added[-1].item.id
    jsonschema.validate(json.loads(done.arguments), WEATHER_SCHEMA)
    completed = events[-1].response
    assert completed.output[-1].type == "function_call"
    assert completed.output[-1].arguments == done.arguments


def test_input_tokens_equals_the_chat_prompt(client, server):
    counted = httpx.post(f"{server.api_url}/responses/input_tokens", json={
        "instructions": INSTRUCTIONS, "input": TURNS}).json()
    chat_count = httpx.post(f"{server.api_url}/chat/completions/input_tokens", json={
        "messages": [{"role": "system", "content": INSTRUCTIONS}, *TURNS]}).json()
    assert counted == {"object": "response.input_tokens",
                       "input_tokens": chat_count["input_tokens"]}


@pytest.mark.parametrize("body, param", [
    ({"input": [{"role": "user", "content": [
        {"type": "input_image", "image_url": "data:image/png;base64,AAAA"}]}]},
     "input.0.content.0"),
    ({"input": "hi", "previous_response_id": "resp_1"}, "previous_response_id"),
    ({"input": "hi", "text": {"format": {"type": "json_schema", "name": "x"}}},
     "text.format.schema"),
    ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools.0"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input.0"),
    ({"input": "hi", "frobnicate": 1}, "frobnicate"),
])
def test_bad_input_is_400_in_openais_shape(client, body, param):
    with pytest.raises(openai.BadRequestError) as err:
        rest = {k: v for k, v in body.items() if k != "input"}
        client.responses.create(model="any", input=body["input"], extra_body=rest)
    assert err.value.status_code == 400
    assert err.value.body["type"] == "invalid_request_error"
    assert err.value.body["param"] == param


def test_json_schema_text_format(client):
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    response = client.responses.create(
        model="any", input="A number as JSON.", temperature=0, max_output_tokens=40,
        text={"format": {"type": "json_schema", "name": "num", "schema": schema}})
    jsonschema.validate(json.loads(response.output_text), schema)


def test_the_clients_stream_helper_accumulates_the_response(client):
    kw = {"model": "any", "input": "Weather?", "tools": [WEATHER], "tool_choice": "required",
          "temperature": 0, "max_output_tokens": 200}
    with client.responses.stream(**kw) as stream:
        for _ in stream:
            pass
        final = stream.get_final_response()
    whole = client.responses.create(**kw)
    assert [(i.type, getattr(i, "arguments", None)) for i in final.output] == [
        (i.type, getattr(i, "arguments", None)) for i in whole.output]
