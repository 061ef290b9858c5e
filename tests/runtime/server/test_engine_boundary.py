"""What a client sends never reaches llama.cpp in a form that throws a C++ exception or
aborts: through ctypes either ends the process. Each case here once killed the server:

- a grammar with a ``logit_bias`` that removes every token it allows: the chain leaves only
  rejected candidates, llama.cpp's grammar accepts one and throws ``Unexpected empty grammar
  stack`` (runtime/engine/sampling.py checks the token against the grammar first);
- a grammar nesting groups 20000 deep: llama.cpp's recursive parser overflowed the stack
  (SIGSEGV; refused past sampling.MAX_GRAMMAR_NESTING).

Both on one slot (``engine.generate``) and with ``-np 2`` (the batch scheduler), where a
request's dead end must fail that request only.
"""
from __future__ import annotations

import json
import threading

import httpx
import pytest

from tests.runtime.server.error_shapes import error_of

# the grammar wants byte 0x01; logit_bias (string keys: every token of the string) sends
# that byte's token to -inf (-1e300 is a float32 -inf)
DEAD_END = {"prompt": "hi", "n_predict": 4, "grammar": 'root ::= "\\u0001"',
            "logit_bias": [["\u0001", -1e300]]}
DEEP = 'root ::= ' + "(" * 20000 + '"a"' + ")" * 20000


@pytest.fixture(scope="module", params=["1", "2"], ids=["np1", "np2"])
def server(request, start_server, tiny_model):
    return start_server(tiny_model, "-np", request.param)


def _post(server, path: str, body: dict, **kw) -> httpx.Response:
    return httpx.post(f"{server.base_url}{path}", content=json.dumps(body),
                      headers={"Content-Type": "application/json"}, timeout=60, **kw)


@pytest.mark.parametrize("temperature", [0, 0.8])
def test_a_grammar_no_token_can_continue_is_a_400(server, temperature):
    body = dict(DEAD_END, temperature=temperature)
    err = error_of(_post(server, "/completion", body), "/completion")
    assert "no token can continue" in err["message"], err
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
            "temperature": temperature, "grammar": DEAD_END["grammar"],
            "logit_bias": {str(t): -100 for t in range(0, 10)}}
    r = _post(server, "/v1/chat/completions", chat)
    # OpenAI's logit_bias stops at -100 (finite): the grammar's token stays possible
    assert r.status_code == 200, r.text
    server.assert_alive()


def test_a_streamed_dead_end_ends_that_stream_only(server):
    other: dict = {}

    def long_stream() -> None:
        with httpx.stream("POST", f"{server.base_url}/completion", timeout=60, json={
                "prompt": "hello", "n_predict": 48, "stream": True}) as r:
            other["status"] = r.status_code
            other["text"] = "".join(r.iter_text())

    t = threading.Thread(target=long_stream)
    t.start()
    with httpx.stream("POST", f"{server.base_url}/completion", timeout=60,
                      json=dict(DEAD_END, stream=True)) as r:
        text = "".join(r.iter_text())
    t.join(60)
    assert "no token can continue" in text, text
    assert other["status"] == 200 and '"stop":true' in other["text"].replace(" ", "")
    assert "error" not in other["text"], other["text"]
    server.assert_alive()


def test_a_grammar_nested_past_the_parsers_depth_is_a_400(server):
    for body in ({"prompt": "hi", "n_predict": 2, "grammar": DEEP},
                 {"prompt": "hi", "n_predict": 2, "stream": True, "grammar": DEEP}):
        err = error_of(_post(server, "/completion", body), "/completion")
        assert "nested 20000 deep" in err["message"] and "limit" in err["message"], err
    r = _post(server, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "grammar": DEEP})
    assert "nested" in error_of(r, "/v1/chat/completions")["message"]
    ok = 'root ::= ' + "(" * 200 + '"a"' + ")" * 200
    assert _post(server, "/completion", {"prompt": "hi", "n_predict": 2,
                                         "grammar": ok}).status_code == 200
    server.assert_alive()
    assert httpx.get(f"{server.base_url}/health", timeout=10).status_code == 200
