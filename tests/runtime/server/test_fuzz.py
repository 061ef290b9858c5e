"""Property-based fuzzing of every generating, token and embedding route's request schema,
the Anthropic Messages and OpenAI Responses APIs included (hypothesis):
whatever the body, the answer is a 2xx, or a 4xx in the route's error shape; never a 5xx, a
stream never carries a server error, and the server still answers /health afterwards.

Bodies are built from each route's fields, each either a plausible value or any JSON value
(huge integers, non-finite numbers, lone surrogates, wrong types, nesting), plus unknown
fields; they are sent as raw JSON text, so NaN / Infinity / "\\ud800" reach the server as a
hostile client would send them. Derandomized: the same examples every run (the seed is the
test's name); bounded to well under a minute on two cores.
"""
from __future__ import annotations

import json
import time

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.runtime.server.error_shapes import error_of

EXAMPLES = 40                          # per route
ODD_TEXT = ["a\ud800b", "\udfff", "\x00", "<|im_start|>", "{{ raise }}", "\u202e", "", " " * 3]

leaf = st.one_of(st.none(), st.booleans(),
                 st.integers(min_value=-2**70, max_value=2**70),
                 st.sampled_from([0, 1, -1, 2**31, 2**63, 2**64, 10**30]),
                 st.floats(allow_nan=True, allow_infinity=True),
                 st.text(max_size=12), st.sampled_from(ODD_TEXT))
any_json = st.recursive(leaf, lambda inner: st.lists(inner, max_size=3)
                        | st.dictionaries(st.text(max_size=6), inner, max_size=3),
                        max_leaves=8)
text = st.one_of(st.text(max_size=20), st.sampled_from(ODD_TEXT))
small = st.integers(min_value=-2, max_value=6)
token = st.one_of(st.integers(min_value=0, max_value=1700),
                  st.sampled_from([-1, 1620, 1621, 2**31, 2**64]))
schema = st.one_of(
    st.sampled_from([{"type": "object"}, {"type": "string", "maxLength": 5},
                     {"type": "nope"}, {"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/a"}}},
                     {"type": "string", "minLength": 10**8}, {"type": "array", "items": {}},
                     {"$ref": "http://example.invalid/x"}, {"pattern": "a{99999}"}]),
    any_json)


def maybe(valid: st.SearchStrategy) -> st.SearchStrategy:
    """A field's value: mostly plausible, sometimes any JSON at all."""
    return st.one_of(valid, valid, any_json)


messages = st.lists(st.fixed_dictionaries(
    {"role": maybe(st.sampled_from(["user", "assistant", "system", "tool", "developer"])),
     "content": maybe(st.one_of(text, st.lists(st.fixed_dictionaries(
         {"type": st.sampled_from(["text", "image_url"]), "text": text}), max_size=2)))}),
    min_size=0, max_size=3)
tools = st.lists(st.fixed_dictionaries(
    {"type": maybe(st.just("function")),
     "function": maybe(st.fixed_dictionaries({"name": maybe(st.just("f")),
                                              "parameters": schema}))}), max_size=2)
sampling = {"temperature": maybe(st.floats(0, 2)), "top_p": maybe(st.floats(0, 1)),
            "top_k": maybe(small), "seed": maybe(st.integers()),
            "stop": maybe(st.lists(text, max_size=2)), "stream": maybe(st.booleans()),
            "presence_penalty": maybe(st.floats(-2, 2)), "grammar": maybe(text),
            "json_schema": schema, "cache_prompt": maybe(st.booleans()),
            "id_slot": maybe(small), "min_p": maybe(st.floats(0, 1))}
openai_bias = st.dictionaries(st.one_of(token.map(str), text), maybe(st.floats(-100, 100)),
                              max_size=2)
native_bias = st.lists(st.lists(st.one_of(token, text, st.floats(), st.booleans()),
                                max_size=3), max_size=2)
prompt_ids = st.lists(token, max_size=4)
FIELDS = {
    "/v1/chat/completions": ({"messages": messages}, sampling | {
        "max_tokens": maybe(small), "n": maybe(st.integers(-1, 3)), "logprobs": maybe(
            st.booleans()), "top_logprobs": maybe(small), "tools": maybe(tools),
        "tool_choice": maybe(st.sampled_from(["auto", "none", "required"])),
        "logit_bias": maybe(openai_bias), "response_format": maybe(st.fixed_dictionaries(
            {"type": st.sampled_from(["text", "json_object", "json_schema", "xml"]),
             "json_schema": st.fixed_dictionaries({"schema": schema})}))}),
    "/v1/completions": ({"prompt": maybe(st.one_of(text, prompt_ids, st.lists(text,
                                                                             max_size=2)))},
                        sampling | {"max_tokens": maybe(small), "echo": maybe(st.booleans()),
                                    "logprobs": maybe(small), "logit_bias": maybe(openai_bias),
                                    "n": maybe(st.integers(-1, 3))}),
    "/completion": ({"prompt": maybe(st.one_of(text, prompt_ids, st.lists(prompt_ids,
                                                                          max_size=2)))},
                    sampling | {"n_predict": maybe(small), "n_probs": maybe(small),
                                "logit_bias": maybe(native_bias),
                                "ignore_eos": maybe(st.booleans()),
                                "response_fields": maybe(st.lists(text, max_size=2)),
                                "return_tokens": maybe(st.booleans()),
                                "n_keep": maybe(small)}),
    "/tokenize": ({"content": maybe(text)}, {"add_special": maybe(st.booleans()),
                                             "with_pieces": maybe(st.booleans())}),
    "/detokenize": ({}, {"tokens": maybe(prompt_ids)}),
    "/apply-template": ({}, {"messages": messages, "tools": maybe(tools),
                             "add_generation_prompt": maybe(st.booleans()),
                             "chat_template_kwargs": maybe(st.dictionaries(
                                 st.text(max_size=5), any_json, max_size=2))}),
    "/infill": ({}, {"input_prefix": maybe(text), "input_suffix": maybe(text),
                     "prompt": maybe(text), "n_predict": maybe(small),
                     "input_extra": maybe(st.lists(any_json, max_size=1))}),
    "/v1/chat/completions/input_tokens": ({"messages": messages}, {"tools": maybe(tools)}),
}
blocks = st.one_of(text, st.lists(st.fixed_dictionaries(
    {"type": maybe(st.sampled_from(["text", "tool_use", "tool_result", "image", "thinking"])),
     "text": maybe(text)}), max_size=2))
FIELDS |= {
    "/v1/messages": ({"messages": st.lists(st.fixed_dictionaries(
        {"role": maybe(st.sampled_from(["user", "assistant"])), "content": maybe(blocks)}),
        max_size=3)}, {"max_tokens": maybe(small), "system": maybe(blocks),
                       "stream": maybe(st.booleans()), "temperature": maybe(st.floats(0, 2)),
                       "stop_sequences": maybe(st.lists(text, max_size=2)),
                       "tools": maybe(st.lists(st.fixed_dictionaries(
                           {"name": maybe(st.just("f")), "input_schema": schema}), max_size=1)),
                       "tool_choice": maybe(st.fixed_dictionaries(
                           {"type": st.sampled_from(["auto", "any", "tool", "none"])}))}),
    "/v1/responses": ({"input": maybe(st.one_of(text, st.lists(st.fixed_dictionaries(
        {"role": maybe(st.just("user")), "content": maybe(text)}), max_size=2)))},
        {"instructions": maybe(text), "max_output_tokens": maybe(small),
         "stream": maybe(st.booleans()), "temperature": maybe(st.floats(0, 2)),
         "text": maybe(st.fixed_dictionaries({"format": st.fixed_dictionaries(
             {"type": st.sampled_from(["text", "json_object", "json_schema"]),
              "schema": schema})})),
         "tools": maybe(st.lists(st.fixed_dictionaries(
             {"type": maybe(st.just("function")), "name": maybe(st.just("f")),
              "parameters": schema}), max_size=1))}),
}
embed_input = maybe(st.one_of(text, prompt_ids, st.lists(st.one_of(text, prompt_ids),
                                                          max_size=3)))
EMBEDDING_FIELDS = {       # served by a second server, started with --embedding
    "/v1/embeddings": ({"input": embed_input}, {"encoding_format": maybe(st.sampled_from(
        ["float", "base64", "hex"])), "model": maybe(text), "dimensions": maybe(small)}),
    "/embedding": ({"content": embed_input}, {"embd_normalize": maybe(small)}),
}
FIELDS |= EMBEDDING_FIELDS


def bodies(path: str) -> st.SearchStrategy:
    required, optional = FIELDS[path]
    body = st.fixed_dictionaries(required, optional=optional)
    extra = st.dictionaries(st.sampled_from(["mirostat", "bogus", "n_ctx", ""]), any_json,
                            max_size=1)
    return st.one_of(st.builds(lambda b, e: b | e, body, extra), body, any_json)


@pytest.fixture(scope="module")
def server(start_server, tiny_model):
    return start_server(tiny_model, "-c", "512")


@pytest.fixture(scope="module")
def embedding_server(start_server, tiny_model):
    return start_server(tiny_model, "--embedding", "--pooling", "mean")


def check_answer(path: str, r: httpx.Response) -> None:
    assert r.status_code < 500, f"{path}: {r.status_code} {r.text[:500]}"
    if r.status_code >= 400:
        error_of(r, path)
        return
    if r.headers.get("content-type", "").startswith("text/event-stream"):
        for line in r.text.splitlines():
            if line.startswith("data: ") and line != "data: [DONE]":
                event = json.loads(line[6:])
                if isinstance(event, dict) and isinstance(event.get("error"), dict):
                    err = event["error"]
                    assert err.get("type") != "server_error" and err.get("code", 400) != 500, err
    else:
        r.json()


@pytest.mark.parametrize("path", list(FIELDS))
def test_any_body_gets_a_2xx_or_a_4xx_in_the_routes_shape(request, path):
    server = request.getfixturevalue("embedding_server" if path in EMBEDDING_FIELDS
                                     else "server")
    http = httpx.Client(base_url=server.base_url, timeout=60)
    t0 = time.monotonic()

    @settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(body=bodies(path))
    def run(body):
        raw = json.dumps(body, allow_nan=True)           # NaN, Infinity, \ud800 as sent
        check_answer(path, http.post(path, content=raw,
                                     headers={"Content-Type": "application/json"}))

    with http:
        run()
        server.assert_alive()
        assert http.get("/health").status_code == 200
    assert time.monotonic() - t0 < 30, "one route's fuzzing must stay bounded"
