"""Structured output, tools, logprobs, logit_bias and n > 1 through the official ``openai``
client against the real server: even the random-weight synthetic model answers JSON that
validates against the schema and tool calls that match the function's parameters, because
llama.cpp's grammar sampler constrains decoding."""
from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import openai
import pytest

N_CTX = 2048
MESSAGES = [{"role": "user", "content": "Describe a pet as JSON."}]

# nested object, enum, array, required keys (strings bounded: a random model never stops
# a string of its own accord)
PET_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "kind": {"enum": ["cat", "dog", "fish"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 3},
        "owner": {"type": "object",
                  "properties": {"age": {"type": "integer"}, "verified": {"type": "boolean"}},
                  "required": ["age", "verified"]},
    },
    "required": ["name", "kind", "tags", "owner"],
}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city",
    "parameters": {"type": "object",
                   "properties": {"city": {"type": "string", "maxLength": 16},
                                  "unit": {"enum": ["celsius", "fahrenheit"]},
                                  "days": {"type": "integer"}},
                   "required": ["city", "unit", "days"]}}}
ADD = {"type": "function", "function": {
    "name": "add", "parameters": {"type": "object",
                                  "properties": {"a": {"type": "integer"},
                                                 "b": {"type": "integer"}},
                                  "required": ["a", "b"]}}}


@pytest.fixture(scope="module")
def server(start_server, tiny_model: Path):
    return start_server(tiny_model, "-c", str(N_CTX))


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.api_url, api_key="unused", max_retries=0, timeout=120)


def _streamed_text(stream) -> str:
    return "".join(c.choices[0].delta.content or "" for c in stream if c.choices)


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_json_schema_answer_parses_and_validates(client, stream, temperature):
    fmt = {"type": "json_schema", "json_schema": {"name": "pet", "schema": PET_SCHEMA}}
    kw = dict(model="m", messages=MESSAGES, response_format=fmt, max_tokens=400,
              temperature=temperature, seed=7)
    if stream:
        text = _streamed_text(client.chat.completions.create(stream=True, **kw))
    else:
        answer = client.chat.completions.create(**kw)
        assert answer.choices[0].finish_reason == "stop"
        text = answer.choices[0].message.content
    jsonschema.validate(json.loads(text), PET_SCHEMA)


def test_json_object_and_grammar_and_llama_json_schema(client):
    answer = client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=60,
                                            temperature=0,
                                            response_format={"type": "json_object"}).choices[0]
    # any object: a random model's keys need not end within 60 tokens, but it is JSON so far
    text = answer.message.content
    assert text.startswith("{") and all(ord(ch) >= 0x20 for ch in text)
    if answer.finish_reason == "stop":
        assert isinstance(json.loads(text), dict)
    text = client.chat.completions.create(   # llama-server's json_object with a schema
        model="m", messages=MESSAGES, max_tokens=400, temperature=0,
        response_format={"type": "json_object", "schema": PET_SCHEMA}).choices[0].message.content
    jsonschema.validate(json.loads(text), PET_SCHEMA)
    text = client.completions.create(model="m", prompt="Answer:", max_tokens=20, temperature=0,
                                     extra_body={"grammar": 'root ::= ("yes" | "no") "!"'}
                                     ).choices[0].text
    assert text in ("yes!", "no!")
    schema = {"type": "array", "items": {"enum": [1, 2, 3]}, "minItems": 2, "maxItems": 2}
    text = client.completions.create(model="m", prompt="Two numbers:", max_tokens=40,
                                     temperature=0, extra_body={"json_schema": schema}
                                     ).choices[0].text
    jsonschema.validate(json.loads(text), schema)


@pytest.mark.parametrize("choice", ["required", {"type": "function",
                                                 "function": {"name": "get_weather"}}])
def test_required_tool_call_has_arguments_matching_the_parameters(client, choice):
    answer = client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "Weather in Paris?"}],
        tools=[WEATHER, ADD], tool_choice=choice, max_tokens=300, temperature=0)
    first = answer.choices[0]
    assert first.finish_reason == "tool_calls"
    calls = first.message.tool_calls
    assert calls and calls[0].type == "function" and calls[0].id
    function = {"get_weather": WEATHER, "add": ADD}[calls[0].function.name]["function"]
    if choice != "required":
        assert calls[0].function.name == "get_weather"
    jsonschema.validate(json.loads(calls[0].function.arguments), function["parameters"])


def test_streamed_tool_call_arrives_as_deltas(client):
    stream = client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "Add 2 and 3."}], tools=[ADD],
        tool_choice="required", max_tokens=200, temperature=0, stream=True)
    name, arguments, finish = "", "", None
    for chunk in stream:
        for choice in chunk.choices:
            for call in choice.delta.tool_calls or []:
                name += call.function.name or ""
                arguments += call.function.arguments or ""
            finish = choice.finish_reason or finish
    assert name == "add" and finish == "tool_calls"
    jsonschema.validate(json.loads(arguments), ADD["function"]["parameters"])


@pytest.mark.parametrize("stream", [False, True])
def test_a_tool_call_cut_by_max_tokens_says_so(client, stream):
    answer = client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "Add 2 and 3."}], tools=[ADD],
        tool_choice="required", max_tokens=24, temperature=0, stream=stream)
    if stream:
        chunks = [c.choices[0] for c in answer if c.choices]
        text = "".join(c.delta.content or "" for c in chunks)
        last = chunks[-1].model_dump()
    else:
        text, last = answer.choices[0].message.content, answer.choices[0].model_dump()
    assert last["finish_reason"] == "length" and text.startswith("<tool_call>")
    assert "max_tokens (24) inside a tool call" in last["note"]         # the hint
    whole = client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "Add 2 and 3."}], tools=[ADD],
        tool_choice="required", max_tokens=200, temperature=0)
    assert "note" not in whole.choices[0].model_dump()


def test_tool_results_in_history_are_accepted(client):
    answer = client.chat.completions.create(model="m", max_tokens=8, temperature=0, messages=[
        {"role": "user", "content": "Add 2 and 3."},
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": "call_1", "type": "function",
            "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "5"}], tools=[ADD])
    assert answer.choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_tool_choice_none_and_auto_answer_text_or_calls(client):
    answer = client.chat.completions.create(model="m", messages=MESSAGES, tools=[ADD],
                                            tool_choice="none", max_tokens=8, temperature=0)
    assert answer.choices[0].message.tool_calls is None
    assert answer.choices[0].finish_reason == "length"


def test_logprobs_one_entry_per_token_with_top_logprobs(client):
    answer = client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=10,
                                            temperature=0, logprobs=True, top_logprobs=3)
    content = answer.choices[0].logprobs.content
    assert len(content) == answer.usage.completion_tokens == 10
    for entry in content:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 3
        tops = [t.logprob for t in entry.top_logprobs]
        assert tops == sorted(tops, reverse=True)
        assert entry.logprob == pytest.approx(tops[0])       # greedy takes the most likely
    assert "".join(e.token for e in content) == answer.choices[0].message.content
    text = client.completions.create(model="m", prompt="The", max_tokens=6, temperature=0,
                                     logprobs=2).choices[0]
    assert len(text.logprobs.tokens) == 6 and all(len(t) == 2 for t in text.logprobs.top_logprobs)
    assert "".join(text.logprobs.tokens) == text.text


def test_n_returns_that_many_choices(client):
    answer = client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=6, n=2,
                                            temperature=0)
    assert [c.index for c in answer.choices] == [0, 1]
    assert answer.choices[0].message.content == answer.choices[1].message.content   # greedy
    assert answer.usage.completion_tokens == 12
    seeded = client.completions.create(model="m", prompt="The", max_tokens=8, n=3,
                                       temperature=1.0, seed=1)
    assert len(seeded.choices) == 3
    streamed = client.completions.create(model="m", prompt="The", max_tokens=4, n=2,
                                         temperature=0, stream=True)
    texts = {0: "", 1: ""}
    for chunk in streamed:
        for c in chunk.choices:
            texts[c.index] += c.text
    assert texts[0] == texts[1] and texts[0]


def test_logit_bias_bans_and_forces_tokens(client):
    plain = client.completions.create(model="m", prompt="The", max_tokens=4, temperature=0,
                                      logprobs=0)
    first = plain.choices[0].logprobs.tokens[0]
    forced = client.completions.create(model="m", prompt="The", max_tokens=3, temperature=0,
                                       logit_bias={"100": 100})
    again = client.completions.create(model="m", prompt="The", max_tokens=3, temperature=0,
                                      logit_bias={"100": 100}, logprobs=0)
    assert forced.choices[0].text == again.choices[0].text
    assert len(set(again.choices[0].logprobs.tokens)) == 1      # one token, thrice
    assert again.choices[0].logprobs.tokens[0] != first or first == again.choices[0].text[:1]


@pytest.mark.parametrize("body,param", [
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format.json_schema"),
    ({"grammar": "root ::= ("}, "grammar"),
    ({"logit_bias": {"abc": 1}}, "logit_bias"),
    ({"logit_bias": {"99999999": 1}}, "logit_bias"),
    ({"tools": [ADD], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice.function.name"),
    ({"top_logprobs": 2}, None),
    ({"audio": {"voice": "x"}}, "audio"),
    ({"prediction": {"type": "content", "content": "x"}}, "prediction"),
])
def test_unsupported_or_bad_fields_are_a_400_naming_the_field(server, body, param):
    import httpx

    r = httpx.post(f"{server.api_url}/chat/completions", timeout=60,
                   json={"model": "m", "messages": MESSAGES, "max_tokens": 4} | body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error"
    if param is not None:
        assert error["param"] == param and param.split(".")[0] in error["message"]
