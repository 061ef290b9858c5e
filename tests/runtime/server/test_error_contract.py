"""One error contract: malformed, out-of-range, non-finite, surrogate-bearing or wrongly typed
input is a 4xx in the route's API shape, never a 5xx, and the server stays up. Each case here
once answered 500 (or was accepted silently); the limits (runtime/server/limits.py) refuse a
request that would hold the server, fast, naming the limit."""
from __future__ import annotations

import json
import time

import httpx
import pytest

from tests.runtime.server.error_shapes import error_of

USER = [{"role": "user", "content": "hi"}]
LOOP = {"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/b"},
                                       "b": {"anyOf": [{"$ref": "#/$defs/a"}]}}}
TREE = {"$ref": "#/$defs/node", "$defs": {"node": {
    "type": "object", "properties": {"v": {"type": "integer"},
                                     "kids": {"type": "array", "items": {"$ref": "#/$defs/node"}}},
    "required": ["v"]}}}

# (path, raw JSON body, a word the message must hold)
CORPUS = [
    ("/v1/chat/completions",
     '{"messages":[{"role":"user","content":"a\\ud800b"}],"max_tokens":2}', "surrogate"),
    ("/v1/completions", '{"prompt":"a\\ud800b","max_tokens":2}', "surrogate"),
    ("/completion", '{"prompt":"a\\ud800b","n_predict":2}', "surrogate"),
    ("/tokenize", '{"content":"a\\ud800b"}', "surrogate"),
    ("/apply-template", '{"messages":[{"role":"user","content":"a\\udfffb"}]}', "surrogate"),
    ("/v1/chat/completions",
     '{"messages":[{"role":"user","content":"hi"}],"stop":["\\ud800"]}', "surrogate"),
    ("/completion", '{"prompt":"hi","temperature":1e999,"n_predict":2}', "finite"),
    ("/completion", '{"prompt":"hi","logit_bias":[[1,1e999]],"n_predict":2}', "finite"),
    ("/completion", '{"prompt":"hi","top_p":NaN,"n_predict":2}', "finite"),
    ("/v1/chat/completions",
     '{"messages":[{"role":"user","content":"hi"}],"temperature":-Infinity}', "finite"),
    ("/completion", '{"prompt":[]}', "empty"),
    ("/completion", '{"prompt":[[]]}', "empty"),
    ("/v1/completions", '{"prompt":[]}', "empty"),
    ("/completion", '{"prompt":[18446744073709551616]}', "18446744073709551616"),
    ("/apply-template", "{}", "messages"),
    ("/apply-template", '{"messages":"hi"}', "messages"),
    ("/apply-template", '{"messages":[{"role":"user","content":"hi"}],'
                        '"add_generation_prompt":"yes"}', "add_generation_prompt"),
    ("/v1/chat/completions", json.dumps({"messages": USER, "tools": [
        {"type": "function", "function": {"name": "f", "parameters": {"type": "nope"}}}],
        "tool_choice": "auto"}), "tools.0.function.parameters"),
    ("/v1/chat/completions", json.dumps({"messages": USER, "max_tokens": 2,
                                         "response_format": {"type": "json_schema",
                                                             "json_schema": {"schema": LOOP}}}),
     "recursive $ref"),
    ("/completion", json.dumps({"prompt": "hi", "json_schema": LOOP}), "recursive $ref"),
    ("/completion", json.dumps({"prompt": "hi", "json_schema": {"$ref": "#/$defs/zz"}}),
     "points to nothing"),
    ("/completion", '{"prompt": "hi", "n_predict": 1e999}', "finite"),
    ("/completion", '[1, 2]', ""),
    ("/v1/chat/completions", '"just a string"', "JSON object"),
    ("/v1/messages", '{"max_tokens":2,"messages":[{"role":"user","content":"a\\ud800b"}]}',
     "surrogate"),
    ("/v1/messages", json.dumps({"max_tokens": 2, "messages": USER, "tools": [
        {"name": "f", "input_schema": LOOP}], "tool_choice": {"type": "any"}}),
     "recursive $ref"),
    ("/v1/responses", '{"input":"hi","temperature":1e999}', "finite"),
    ("/v1/responses", json.dumps({"input": "hi", "text": {"format": {
        "type": "json_schema", "name": "x", "schema": {"type": "string",
                                                       "minLength": 10**8}}}}), "minLength"),
    ("/detokenize", '{"tokens": "abc"}', "tokens"),
    ("/detokenize", '{"tokens": [1.5]}', "tokens"),
    # numbers past 64 bits (an OverflowError, a 500, or accepted and echoed before)
    ("/completion", '{"prompt":"hi","n_predict":2,"logit_bias":[[1,' + "9" * 400 + "]]}",
     "64-bit"),
    ("/v1/chat/completions", '{"messages":[{"role":"user","content":"hi"}],"max_tokens":2,'
                             '"logit_bias":{"1":' + "9" * 400 + "}}", "64-bit"),
    ("/completion", '{"prompt":"hi","n_predict":2,"top_k":%d}' % 2**70, "64-bit"),
    ("/v1/chat/completions", '{"messages":[{"role":"user","content":"hi"}],"seed":%d}' % 2**70,
     "64-bit"),
    ("/completion", '{"prompt":"hi","json_schema":{"type":"integer","minimum":1%s}}' % ("0" * 400),
     "64-bit"),
    ("/completion", '{"prompt":"hi","n_predict":2,"top_k":%d}' % 2**40, "top_k"),
    ("/completion", '{"prompt":"hi","n_predict":2,"seed":1e25}', "seed"),
    # a logit_bias entry that is not a [token, bias] pair (an IndexError, a 500, before)
    ("/completion", '{"prompt":"hi","n_predict":2,"logit_bias":[[]]}', "not a pair"),
    ("/completion", '{"prompt":"hi","n_predict":2,"logit_bias":[[1,2,3]]}', "not a pair"),
]

# (path, body, the limit's words in the message): refused at once
LIMITS = [
    ("/completion", {"prompt": "hi", "json_schema": {"type": "string", "minLength": 100_000_000}},
     "minLength 100000000"),
    ("/v1/chat/completions", {"messages": USER, "response_format": {
        "type": "json_schema", "json_schema": {"schema": {
            "type": "array", "items": {"type": "string"}, "maxItems": 10**9}}}}, "maxItems"),
    ("/v1/completions", {"prompt": "hi", "json_schema": {"type": "string",
                                                         "pattern": "(a{1000}){1000}"}},
     "pattern repetition"),
    ("/completion", {"prompt": "hi", "grammar": 'root ::= "a"{100000000}'}, "repetition"),
    ("/completion", {"prompt": "hi", "json_schema": {"type": "object", "properties": {
        f"p{i}": {"type": "string", "maxLength": 900} for i in range(20)}}}, "adding up to"),
    ("/v1/chat/completions", {"messages": USER, "tool_choice": "required", "tools": [
        {"type": "function", "function": {"name": "f", "parameters": {
            "type": "object", "properties": {"x": {"type": "string", "minLength": 10**7}}}}}]},
     "minLength"),
    ("/completion", {"prompt": "word " * 1200}, "--max-prompt-tokens"),
    ("/v1/completions", {"prompt": list(range(1100)), "max_tokens": 1}, "--max-prompt-tokens"),
]


@pytest.fixture(scope="module")
def server(start_server, tiny_model, tmp_path_factory):
    return start_server(tiny_model, "--max-prompt-tokens", "1000", "--max-body-mib", "1",
                        "--slot-save-path", str(tmp_path_factory.mktemp("slots")))


def _a_normal_request_succeeds(server) -> None:
    r = httpx.post(f"{server.base_url}/completion", json={"prompt": "hi", "n_predict": 1},
                   timeout=60)
    assert r.status_code == 200, r.text


def _post(server, path: str, raw: str | bytes) -> httpx.Response:
    return httpx.post(f"{server.base_url}{path}", content=raw,
                      headers={"Content-Type": "application/json"}, timeout=60)


@pytest.mark.parametrize("path,raw,word", CORPUS, ids=[f"{p} {r[:40]}" for p, r, _ in CORPUS])
def test_bad_input_is_a_4xx_in_the_routes_shape(server, path, raw, word):
    err = error_of(_post(server, path, raw), path)
    assert word in err["message"], err
    assert httpx.get(f"{server.base_url}/health", timeout=10).status_code == 200
    _a_normal_request_succeeds(server)


# Every failure class of a request on every API's routes, each in that API's shape (OpenAI,
# Anthropic, llama-server): once, deep JSON was a 500 RecursionError on the routes that read
# their body themselves, and unreadable bodies and 405s answered in OpenAI's shape everywhere.
ROUTES = ["/v1/chat/completions", "/v1/completions", "/v1/messages", "/v1/responses",
          "/completion", "/tokenize", "/detokenize", "/infill", "/apply-template",
          "/slots/0?action=save"]
FAILURES = {    # class: (raw body or an HTTP method, a word the message must hold)
    "parse": (b'{"messages": [', "parse"),
    "nesting": (('{"a":' * 100_000 + "1" + "}" * 100_000).encode(), "--max-json-depth"),
    "encoding": (b'{"prompt": "caf\xe9", "content": "\xff"}'.decode("unicode_escape")
                 .encode("latin-1"), "UTF-8"),
    "size": (b'{"prompt": "' + b"x" * (1 << 20) + b'"}', "--max-body-mib"),
    "method": ("PUT", "not allowed"),
}


@pytest.mark.parametrize("kind", list(FAILURES))
@pytest.mark.parametrize("path", ROUTES)
def test_every_failure_class_answers_in_the_apis_shape(server, path, kind):
    body, word = FAILURES[kind]
    if isinstance(body, str):
        r = httpx.request(body, f"{server.base_url}{path}", timeout=60)
    else:
        r = _post(server, path, body)
    err = error_of(r, path.split("?")[0])
    assert word in err["message"], err
    assert (r.status_code == 405) == (kind == "method"), r.status_code
    _a_normal_request_succeeds(server)


@pytest.mark.parametrize("path,body,words", LIMITS, ids=[w for _, _, w in LIMITS])
def test_limits_refuse_fast_and_name_themselves(server, path, body, words):
    t0 = time.monotonic()
    err = error_of(_post(server, path, json.dumps(body)), path)
    assert time.monotonic() - t0 < 5, "a refused request must not do the work first"
    assert words in err["message"] and "limit" in err["message"], err


def test_a_body_over_the_limit_is_a_400_naming_it(server):
    big = json.dumps({"prompt": "x" * (2 << 20)})
    for path in ("/completion", "/v1/completions", "/v1/messages"):
        r = _post(server, path, big)
        message = error_of(r, path)["message"]
        assert r.status_code == 400 and "--max-body-mib" in message and "limit" in message

    def chunks():                       # no Content-Length: counted as it arrives
        yield b'{"prompt": "'
        for _ in range(40):
            yield b"x" * (64 << 10)
        yield b'"}'
    r = httpx.post(f"{server.base_url}/v1/completions", content=chunks(),
                   headers={"Content-Type": "application/json"}, timeout=60)
    assert r.status_code == 400 and "request body" in error_of(r, "/v1/completions")["message"]
    server.assert_alive()


def test_what_the_limits_and_checks_let_through(server):
    """A recursive schema llama.cpp's converter supports is accepted (it answered a bare
    KeyError before), as are valid surrogate pairs, big finite numbers, and the counts at
    the limit."""
    base = server.base_url
    r = httpx.post(f"{base}/completion", json={"prompt": "hi", "n_predict": 8,
                                                "json_schema": TREE, "temperature": 0}, timeout=60)
    assert r.status_code == 200, r.text
    r = httpx.post(f"{base}/v1/chat/completions", json={
        "messages": USER, "max_tokens": 4, "response_format": {
            "type": "json_schema", "json_schema": {"name": "t", "schema": TREE}}}, timeout=60)
    assert r.status_code == 200, r.text
    r = _post(server, "/tokenize", '{"content":"smile \\ud83d\\ude00 1e5"}')
    assert r.status_code == 200, r.text
    r = _post(server, "/completion", '{"prompt":"hi","n_predict":1,"temperature":1e-300,'
                                     '"seed":12345678901234}')
    assert r.status_code == 200, r.text
    r = httpx.post(f"{base}/completion", json={"prompt": "hi", "n_predict": 2, "json_schema": {
        "type": "string", "maxLength": 1000}}, timeout=60)
    assert r.status_code == 200, r.text
    r = httpx.post(f"{base}/completion", json={"prompt": "hi", "n_predict": 2, "grammar":
                   'root ::= "{99999}" [{}0-9]{0,8}'}, timeout=60)   # braces in literals
    assert r.status_code == 200, r.text
    r = httpx.post(f"{base}/v1/chat/completions", json={"messages": USER, "max_tokens": 2,
                   "tools": [{"type": "function", "function": {"name": "f", "parameters": {
                       "type": "object", "properties": {"a": {"type": "string"}}}}}]},
                   timeout=60)
    assert r.status_code == 200, r.text
    # the recursive tree response_format takes is a tool's parameters too, forced or not (a
    # forced call's grammar once looked its $defs up from the call's root: "points to nothing")
    for choice in ("auto", "required"):
        r = httpx.post(f"{base}/v1/chat/completions", json={
            "messages": USER, "max_tokens": 4, "tool_choice": choice, "tools": [
                {"type": "function", "function": {"name": "f", "parameters": TREE}},
                {"type": "function", "function": {"name": "g", "parameters": TREE}}]},
            timeout=60)
        assert r.status_code == 200, r.text


def test_logit_bias_false_bans_the_token_as_llama_server_does(server):
    """llama-server's ``false`` is a bias of -inf: the token cannot come out, even when every
    other token is pushed down by -100 (with false as -100, the greedy pick came out)."""
    base = server.base_url
    greedy = {"prompt": "Once upon a time", "n_predict": 1, "temperature": 0,
              "return_tokens": True}
    first = httpx.post(f"{base}/completion", json=greedy, timeout=60).json()["tokens"][0]
    n_vocab = int(httpx.post(f"{base}/detokenize", json={"tokens": [10**6]}, timeout=30)
                  .json()["error"]["message"].split("n_vocab ")[1].split(":")[0])
    bias = [[t, -100] for t in range(n_vocab) if t != first] + [[first, False]]
    r = httpx.post(f"{base}/completion", json=greedy | {"logit_bias": bias}, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["tokens"][0] != first
    assert {"token": first, "bias": None} in r.json()["generation_settings"]["logit_bias"]


def test_the_cases_left_the_log_clean(server):
    """No request above made the server print a traceback or a 500."""
    page = httpx.get(f"{server.base_url}/metrics", timeout=10).text
    assert 'status="500"' not in page
    assert "Traceback" not in server.log()
