"""Resumable streams on the real server (``X-Conversation-Id``, ``/v1/stream``,
``/v1/streams/lookup``): a replay gives the same bytes, a client that leaves does not stop
the answer, and DELETE stops it."""
from __future__ import annotations

import json
import time

import httpx
import pytest

CHAT = {"messages": [{"role": "user", "content": "hello"}], "stream": True,
        "temperature": 0}


@pytest.fixture(scope="module")
def server(start_server, tiny_model):
    return start_server(tiny_model)


@pytest.fixture()
def http(server):
    with httpx.Client(base_url=server.base_url, timeout=60) as client:
        yield client


def _events(raw: bytes) -> list:
    return [e.removeprefix("data: ") for e in raw.decode().split("\n\n") if e]


def _wait_done(http, conv: str, timeout_s: float = 60) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = http.post("/v1/streams/lookup", json={"conversation_ids": [conv]}).json()
        if found and found[0]["is_done"]:
            return found[0]
        time.sleep(0.05)
    raise AssertionError(f"{conv}: not done in {timeout_s} s")


def test_replay_gives_the_same_bytes_then_delete_drops_it(http):
    conv = "conv-a::org/model"                       # slashes travel in the query string
    with http.stream("POST", "/v1/chat/completions", json=CHAT | {"max_tokens": 12},
                     headers={"X-Conversation-Id": conv}) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        first = r.read()
    events = _events(first)
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["choices"][0]["finish_reason"] == "length"
    info = _wait_done(http, "conv-a")                # the id before "::" finds it too
    assert info["conversation_id"] == conv and info["total_bytes"] == len(first)
    assert http.post("/v1/streams/lookup", json={"conversation_ids": ["other"]}).json() == []
    for bad in ({}, {"conversation_ids": conv}, {"conversation_ids": [conv, 7]},
                {"conversation_ids": [""]}, {"conversation_ids": [conv], "ids": [conv]}):
        got = http.post("/v1/streams/lookup", json=bad)
        assert got.status_code == 400, bad
        assert got.json()["error"]["type"] == "invalid_request_error", bad
    again = http.get("/v1/stream", params={"conv_id": conv, "from": 0})
    assert again.status_code == 200 and again.content == first
    tail = http.get("/v1/stream", params={"conv_id": conv, "from": 10})
    assert tail.content == first[10:]
    assert http.get("/v1/stream", params={"conv_id": conv, "from": "x"}).status_code == 400
    assert http.get("/v1/stream").status_code == 400
    assert http.delete("/v1/stream", params={"conv_id": conv}).status_code == 204
    gone = http.get("/v1/stream", params={"conv_id": conv, "from": 0})
    assert gone.status_code == 404 and gone.json()["error"]["type"] == "not_found_error"
    assert http.delete("/v1/stream", params={"conv_id": conv}).status_code == 204


def test_the_answer_goes_on_after_the_client_leaves(http):
    conv = "conv-b"
    with http.stream("POST", "/completion", json={"prompt": "once upon", "n_predict": 200,
                                                  "stream": True, "temperature": 0},
                     headers={"X-Conversation-Id": conv}) as r:
        assert r.status_code == 200
        next(r.iter_bytes())                         # one chunk, then the client leaves
    _wait_done(http, conv)
    replay = _events(http.get("/v1/stream", params={"conv_id": conv}).content)
    last = json.loads(replay[-1])
    assert last["stop"] is True and last["stop_type"] in ("limit", "eos")
    assert last["tokens_predicted"] == 200 or last["stop_type"] == "eos"
    assert sum(1 for e in replay if json.loads(e)["stop"] is False) >= last["tokens_predicted"]


def test_delete_stops_the_generation(http):
    conv = "conv-c"
    t0 = time.monotonic()
    with http.stream("POST", "/v1/completions",
                     json={"prompt": "once upon", "max_tokens": 100000, "stream": True,
                           "ignore_eos": True},
                     headers={"X-Conversation-Id": conv}) as r:
        chunks = r.iter_bytes()
        next(chunks)
        assert http.delete("/v1/stream", params={"conv_id": conv}).status_code == 204
        rest = b"".join(chunks)                      # the answer ends (no [DONE])
    assert b"[DONE]" not in rest
    assert time.monotonic() - t0 < 30
    assert http.post("/v1/streams/lookup", json={"conversation_ids": [conv]}).json() == []
    # the engine is free again at once
    r = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
    assert r.status_code == 200, r.text
