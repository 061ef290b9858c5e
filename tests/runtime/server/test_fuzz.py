"""Property-based fuzzing of every generating, token and embedding route's request schema,
the Anthropic Messages and OpenAI Responses APIs included, and of the routes that take their
input in the URL (slot actions, the CORS proxy, stream sessions; hypothesis):
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
from urllib.parse import quote

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.runtime.server.error_shapes import error_of

EXAMPLES = 40                          # per route
URL_EXAMPLES = 25                      # per route taking its input in the URL
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
def server(start_server, tiny_model, tmp_path_factory):
    return start_server(tiny_model, "-c", "512", "--ui-mcp-proxy", "--slot-save-path",
                        str(tmp_path_factory.mktemp("slots")))


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


# -- routes whose input is in the URL ---------------------------------------------------------

# hosts the proxy must refuse without resolving a name elsewhere (no DNS query leaves the
# machine): loopback, private, link-local, metadata and multicast in several spellings
PROXY_HOSTS = ["127.0.0.1", "[::1]", "localhost", "10.0.0.1", "169.254.169.254", "2130706433",
               "0", "0x7f.1", "0177.0.0.1", "[::ffff:127.0.0.1]", "224.0.0.1", "192.168.1.1",
               "[fe80::1]", "", "[", "a b", "%zz", "127.0.0.1:99999", "[::1"]
proxy_url = st.one_of(
    st.builds(lambda scheme, host, path: f"{scheme}{host}{path}",
              st.sampled_from(["http://", "https://", "ftp://", "file://", "", "http:/",
                               "javascript:", "HTTP://"]),
              st.sampled_from(PROXY_HOSTS), st.sampled_from(["", "/", "/x?y=1", "/../..",
                                                             "/\u0000", "#f"])),
    st.sampled_from(["", "not a url", "http://", "://x", "http://[::1]:0/"]))
query_text = st.one_of(text, st.sampled_from(["0", "1", "-1", "99999999999999999999", "1e3",
                                              "0x1", "", "%00"]))


def _q(value: str) -> str:
    """``value`` percent-encoded (a lone surrogate as the invalid UTF-8 bytes it makes)."""
    return quote(value.encode("utf-8", "surrogatepass"), safe="")


# (method, path as the error shape knows it, strategy of (URL, raw body or None))
URL_ROUTES = {
    "POST /slots/{id}": ("POST", "/slots/0", st.builds(
        lambda slot, action, body: (f"/slots/{_q(slot)}?action={_q(action)}",
                                    json.dumps(body, allow_nan=True)),
        st.one_of(st.sampled_from(["0", "1", "-1", "2", "x", "1e2", "99999999999999999999"]),
                  text),
        st.one_of(st.sampled_from(["save", "restore", "erase", "", "SAVE"]), text),
        st.one_of(st.fixed_dictionaries({"filename": maybe(st.one_of(
            text, st.sampled_from(["a.bin", "../x", "/etc/passwd", ".", "..", "a/b",
                                   "x" * 300, " a"])))}), any_json))),
    "GET /slots": ("GET", "/slots", st.builds(
        lambda v: (f"/slots?fail_on_no_slot={_q(v)}", None), query_text)),
    "GET /cors-proxy": ("GET", "/cors-proxy", st.builds(
        lambda url: (f"/cors-proxy?url={_q(url)}", None), proxy_url)),
    "POST /cors-proxy": ("POST", "/cors-proxy", st.builds(
        lambda url, body: (f"/cors-proxy?url={_q(url)}", body), proxy_url,
        st.one_of(st.just(None), text))),
    "GET /v1/stream": ("GET", "/v1/stream", st.builds(
        lambda conv, offset: (f"/v1/stream?conv_id={_q(conv)}&from={_q(offset)}", None),
        query_text, query_text)),
    "DELETE /v1/stream": ("DELETE", "/v1/stream", st.builds(
        lambda conv: (f"/v1/stream?conv_id={_q(conv)}", None), query_text)),
    "POST /v1/streams/lookup": ("POST", "/v1/streams/lookup", st.builds(
        lambda body: ("/v1/streams/lookup", json.dumps(body, allow_nan=True)),
        st.one_of(st.fixed_dictionaries({"conversation_ids": maybe(st.lists(text,
                                                                             max_size=3))}),
                  any_json))),
    "POST /v1/messages/count_tokens": ("POST", "/v1/messages/count_tokens", st.builds(
        lambda body: ("/v1/messages/count_tokens", json.dumps(body, allow_nan=True)),
        st.one_of(st.fixed_dictionaries({"messages": st.lists(st.fixed_dictionaries(
            {"role": maybe(st.sampled_from(["user", "assistant"])),
             "content": maybe(blocks)}), max_size=2)}), any_json))),
    "POST /v1/responses/input_tokens": ("POST", "/v1/responses/input_tokens", st.builds(
        lambda body: ("/v1/responses/input_tokens", json.dumps(body, allow_nan=True)),
        st.one_of(st.fixed_dictionaries({"input": maybe(text)}), any_json))),
}


@pytest.mark.parametrize("route", list(URL_ROUTES))
def test_any_url_gets_a_2xx_or_a_4xx_in_the_routes_shape(server, route):
    method, path, requests = URL_ROUTES[route]
    http = httpx.Client(base_url=server.base_url, timeout=60)
    t0 = time.monotonic()

    @settings(max_examples=URL_EXAMPLES, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(request=requests)
    def run(request):
        url, raw = request
        headers = {"Content-Type": "application/json"} if raw is not None else {}
        content = raw.encode("utf-8", "surrogatepass") if raw is not None else None
        r = http.request(method, url, content=content, headers=headers)
        if r.status_code == 307:     # /slots/?...: Starlette's slash redirect, nothing else
            assert r.headers["location"].split("?")[0].endswith(url.split("?")[0].rstrip("/"))
            return
        if r.status_code == 204:     # DELETE /v1/stream: stopped (or nothing to stop)
            assert r.content == b""
            return
        check_answer(path, r)

    with http:
        run()
        server.assert_alive()
        assert http.get("/health").status_code == 200
    assert time.monotonic() - t0 < 30, "one route's fuzzing must stay bounded"
