"""A server started with ``--api-key`` and ``--queue-size 0``: authentication (401s, the
official client with the key) and the queue bound (429 while one request runs)."""
from __future__ import annotations

import json
import time
from pathlib import Path

import httpx
import openai
import pytest

KEY = "sk-test-9f2c"
PROMPT = "the king saw a river near the old house and"


@pytest.fixture(scope="module")
def server(start_server, tiny_model: Path):
    return start_server(tiny_model, "--api-key", KEY, "--queue-size", "0")


def _auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def test_health_and_model_list_need_no_key(server) -> None:   # as llama-server
    r = httpx.get(f"{server.base_url}/health")
    assert r.status_code == 200 and r.json() == {"status": "ok"}
    for path in ("/v1/models", "/models"):
        assert httpx.get(f"{server.base_url}{path}").status_code == 200


def test_x_api_key_header_and_cors_preflight(server) -> None:
    r = httpx.post(f"{server.base_url}/v1/completions", headers={"X-Api-Key": KEY},
                   json={"prompt": PROMPT, "max_tokens": 2})
    assert r.status_code == 200, r.text
    r = httpx.options(f"{server.base_url}/v1/chat/completions", headers={
        "Origin": "http://example.test", "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization,content-type"})
    assert r.status_code == 200
    assert r.headers["access-control-allow-origin"] in ("*", "http://example.test")


@pytest.mark.parametrize("method,path", [("POST", "/v1/completions"),
                                         ("POST", "/v1/chat/completions"), ("GET", "/metrics"),
                                         ("GET", "/v1/residency")])
def test_missing_or_wrong_key_is_401(server, method: str, path: str) -> None:
    body = {"prompt": PROMPT, "max_tokens": 2} if method == "POST" else None
    for headers, code in (({}, "missing_api_key"), (_auth("sk-wrong"), "invalid_api_key"),
                          ({"Authorization": KEY}, "missing_api_key")):
        r = httpx.request(method, f"{server.base_url}{path}", json=body, headers=headers)
        assert r.status_code == 401, r.text
        error = r.json()["error"]
        assert error["type"] == "authentication_error" and error["code"] == code
        assert error["message"]


def test_official_client_with_the_key_is_served(server, tiny_model: Path) -> None:
    client = openai.OpenAI(base_url=server.api_url, api_key=KEY, max_retries=0, timeout=60)
    # without --alias the model is named after its file, less ".gguf"
    assert [m.id for m in client.models.list().data] == [tiny_model.stem]
    reply = client.chat.completions.create(model="any", max_tokens=4,
                                           messages=[{"role": "user", "content": "hello"}])
    assert reply.choices[0].message.role == "assistant"
    wrong = openai.OpenAI(base_url=server.api_url, api_key="sk-wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong.chat.completions.create(model="any", max_tokens=2,
                                      messages=[{"role": "user", "content": "hello"}])


def test_queue_full_is_429_and_clears(server) -> None:
    body = {"prompt": PROMPT, "max_tokens": 4000, "temperature": 0, "stream": True}
    with httpx.Client(base_url=server.base_url, headers=_auth(KEY), timeout=60) as client:
        with client.stream("POST", "/v1/completions", json=body) as running:
            assert running.status_code == 200
            # keep the line iterator referenced: dropping it would close the connection
            lines = running.iter_lines()
            first = next(line for line in lines if line.startswith("data: "))
            assert json.loads(first[6:])["object"] == "text_completion"
            # one request is generating and --queue-size 0 lets none wait
            r = client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2})
            assert r.status_code == 429, r.text
            error = r.json()["error"]
            assert error["type"] == "rate_limit_error" and error["code"] == "queue_full"
            assert r.headers.get("retry-after")
            # the running stream was not disturbed: it is still delivering text
            assert next(line for line in lines if line.startswith("data: "))
        # the stream was dropped: its generation stops and the next request is served
        deadline = time.monotonic() + 30
        while True:
            r = client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2})
            if r.status_code != 429 or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        assert r.status_code == 200, r.text
