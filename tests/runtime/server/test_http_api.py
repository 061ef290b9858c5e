"""The real server over raw HTTP: health, metrics, residency, every error case, concurrent
clients, and a client that drops mid-stream."""
from __future__ import annotations

import json
import re
import threading
import time
from pathlib import Path

import httpx
import pytest

N_CTX = 4096
PROMPT = "the king saw a river near the old house and"
# Tokens: greedy decoding of PROMPT on the tiny model runs this long without an end token —
# seconds of work, so a client can leave while it is surely still generating.
LONG = 4000


@pytest.fixture(scope="module")
def server(start_server, tiny_model: Path):
    return start_server(tiny_model, "-c", str(N_CTX))


@pytest.fixture()
def http(server):
    with httpx.Client(base_url=server.base_url, timeout=60) as client:
        yield client
    server.assert_alive()


def _assert_openai_error(response: httpx.Response, status: int, error_type: str,
                         code: str | None = None) -> dict:
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    body = response.json()
    assert set(body) == {"error"}
    error = body["error"]
    assert {"message", "type", "code"} <= set(error)
    assert isinstance(error["message"], str) and error["message"]
    assert error["type"] == error_type
    if code is not None:
        assert error["code"] == code
    return error


def _metric(text: str, name: str, labels: str = "") -> float:
    label_part = r"\{" + re.escape(labels) + r"\}" if labels else ""
    pattern = "^" + re.escape(name) + label_part + r" (\S+)$"
    values = [float(m.group(1)) for m in re.finditer(pattern, text, re.M)]
    return values[0] if values else 0.0


def _wait_idle(http: httpx.Client, timeout: float = 30) -> str:
    """Poll /metrics until no request is running or waiting; return the page."""
    deadline = time.monotonic() + timeout
    while True:
        page = http.get("/metrics").text
        busy = _metric(page, "moe_server_requests_running") + _metric(
            page, "moe_server_requests_waiting")
        if busy == 0 or time.monotonic() > deadline:
            assert busy == 0, "the server never went idle"
            return page
        time.sleep(0.05)


def test_health_is_ok_once_loaded(server, http: httpx.Client) -> None:
    r = http.get("/health")
    assert r.status_code == 200
    assert r.json() == {"status": "ok"}
    # the server listened before the model was loaded: until then /health said so
    statuses = [status for status, _ in server.health_seen]
    assert statuses[-1] == 200 and set(statuses[:-1]) <= {503}
    for _, body in server.health_seen[:-1]:
        assert body["error"]["type"] == "unavailable_error"
        assert body["error"]["code"] == "model_loading"


def test_metrics_count_requests_and_tokens(http: httpx.Client) -> None:
    before = _wait_idle(http)
    r = http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 5, "temperature": 0})
    assert r.status_code == 200, r.text
    usage = r.json()["usage"]
    after = http.get("/metrics")
    assert after.headers["content-type"].startswith("text/plain")
    page = after.text
    for name in ("moe_server_prompt_tokens_total", "moe_server_completion_tokens_total"):
        assert f"# TYPE {name} counter" in page
    assert _metric(page, "moe_server_prompt_tokens_total") - _metric(
        before, "moe_server_prompt_tokens_total") == usage["prompt_tokens"]
    assert _metric(page, "moe_server_completion_tokens_total") - _metric(
        before, "moe_server_completion_tokens_total") == usage["completion_tokens"]
    label = 'path="/v1/completions",status="200"'
    assert _metric(page, "moe_server_requests_total", label) == _metric(
        before, "moe_server_requests_total", label) + 1
    assert _metric(page, "moe_server_model_ready") == 1
    # the residency manager's own series ride along
    assert re.search(r"^moe_expert_\w+(\{[^}]*\})? \S+$", page, re.M), page


def test_metrics_show_the_ram_tier_next_to_the_manager(start_server, tiny_model: Path) -> None:
    """With a cpu budget the RAM tier attaches; /metrics carries its mincore truth too."""
    server = start_server(tiny_model, "-c", "512", "--devices.cpu", "512KiB")
    with httpx.Client(base_url=server.base_url, timeout=60) as client:
        r = client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 4,
                                                 "temperature": 0})
        assert r.status_code == 200, r.text
        page = client.get("/metrics").text
    manager_view = _metric(page, "moe_ramtier_resident_bytes", 'view="manager"')
    assert 0 < manager_view <= _metric(page, "moe_ramtier_budget_bytes") == 512 << 10
    assert _metric(page, "moe_ramtier_resident_bytes", 'view="mincore"') > 0
    assert _metric(page, "moe_expert_accesses_total", 'device="cpu",phase="prefill"') > 0


def _accesses(snapshot: dict, phase: str) -> int:
    return sum(device["phases"][phase]["accesses"] for device in snapshot["devices"].values())


def test_residency_snapshot_follows_generation(http: httpx.Client) -> None:
    _wait_idle(http)
    before = http.get("/v1/residency").json()
    r = http.post("/v1/completions", json={"prompt": "a new prompt about the moon",
                                           "max_tokens": 4, "temperature": 0})
    assert r.status_code == 200, r.text
    response = http.get("/v1/residency")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("application/json")
    after = response.json()
    # the routing hook fed the manager: prompt tokens as prefill, new tokens as decode
    assert _accesses(after, "prefill") > _accesses(before, "prefill")
    assert _accesses(after, "decode") > _accesses(before, "decode")
    page = http.get("/metrics").text
    for name, device in after["devices"].items():
        for phase, counters in device["phases"].items():
            assert counters["hits"] + counters["misses"] == counters["accesses"]
            labels = f'device="{name}",phase="{phase}"'
            assert _metric(page, "moe_expert_accesses_total", labels) == counters["accesses"]


# --- errors ------------------------------------------------------------------------------

def test_invalid_json_is_400(http: httpx.Client) -> None:
    r = http.post("/v1/chat/completions", content=b'{"messages": [',
                  headers={"content-type": "application/json"})
    _assert_openai_error(r, 400, "invalid_request_error")


def test_body_that_is_not_an_object_is_400(http: httpx.Client) -> None:
    r = http.post("/v1/completions", json=[1, 2, 3])
    _assert_openai_error(r, 400, "invalid_request_error")


@pytest.mark.parametrize("path,body,param", [
    ("/v1/chat/completions", {"max_tokens": 4}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}, None),
    ("/v1/chat/completions", {"messages": "hello"}, "messages"),
    ("/v1/completions", {"prompt": PROMPT, "temperature": "hot"}, "temperature"),
    ("/v1/completions", {"prompt": PROMPT, "max_tokens": 0}, "max_tokens"),
    ("/v1/completions", {"prompt": PROMPT, "top_p": 1.5}, "top_p"),
    ("/v1/completions", {"prompt": PROMPT, "n": 0}, "n"),
    ("/v1/completions", {"prompt": PROMPT, "frobnicate": 1}, "frobnicate"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                              "functions": []}, "functions"),
    ("/v1/completions", {"prompt": PROMPT, "stop": [""]}, "stop"),
    ("/v1/completions", {"max_tokens": 4}, "prompt"),
])
def test_invalid_fields_are_400_not_422(http: httpx.Client, path: str, body: dict,
                                        param: str | None) -> None:
    error = _assert_openai_error(http.post(path, json=body), 400, "invalid_request_error")
    if param is not None:
        assert error["param"] == param


def test_prompt_beyond_context_is_400(http: httpx.Client) -> None:
    long_prompt = " ".join(["water"] * (N_CTX + 10))
    r = http.post("/v1/chat/completions",
                  json={"messages": [{"role": "user", "content": long_prompt}], "stream": True})
    error = _assert_openai_error(r, 400, "exceed_context_size_error", "context_length_exceeded")
    assert error["n_ctx"] == N_CTX and error["n_prompt_tokens"] > N_CTX   # llama-server's


def test_unknown_route_is_404(http: httpx.Client) -> None:
    _assert_openai_error(http.get("/v1/engines"), 404, "invalid_request_error", "unknown_url")
    _assert_openai_error(http.post("/v2/chat/completions", json={}), 404,
                         "invalid_request_error")


def test_wrong_method_is_405(http: httpx.Client) -> None:
    _assert_openai_error(http.get("/v1/chat/completions"), 405, "invalid_request_error")


def test_out_of_vocabulary_token_prompt_is_refused_not_fatal(http: httpx.Client) -> None:
    r = http.post("/v1/completions", json={"prompt": [1, 10_000_000], "max_tokens": 2})
    _assert_openai_error(r, 400, "invalid_request_error")
    assert http.get("/health").status_code == 200


# --- concurrency and disconnects ---------------------------------------------------------

def test_four_concurrent_clients_are_all_answered(server, http: httpx.Client) -> None:
    results: dict[int, tuple[int, str]] = {}

    def ask(i: int) -> None:
        body = {"messages": [{"role": "user", "content": f"client {i}: the sea"}],
                "max_tokens": 8, "temperature": 0, "stream": i % 2 == 1}
        with httpx.Client(base_url=server.base_url, timeout=120) as client:
            if body["stream"]:
                with client.stream("POST", "/v1/chat/completions", json=body) as r:
                    lines = [line for line in r.iter_lines() if line.startswith("data: ")]
                    results[i] = (r.status_code, lines[-1])
            else:
                r = client.post("/v1/chat/completions", json=body)
                results[i] = (r.status_code, r.json()["choices"][0]["finish_reason"])

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=180)
    assert sorted(results) == [0, 1, 2, 3]
    for i, (status, last) in results.items():
        assert status == 200
        if i % 2:
            assert last == "data: [DONE]"
        else:
            assert last in ("stop", "length")


def test_client_dropping_mid_stream_frees_the_engine(server, http: httpx.Client) -> None:
    before = _wait_idle(http)
    body = {"prompt": PROMPT, "max_tokens": LONG, "temperature": 0, "stream": True}
    with httpx.Client(base_url=server.base_url, timeout=60) as dropper:
        with dropper.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            first = next(line for line in lines if line.startswith("data: "))
            assert json.loads(first[6:])["choices"][0]["text"] is not None
        # leaving the block closes the connection mid-stream
    t0 = time.monotonic()
    r = http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 4, "temperature": 0})
    assert r.status_code == 200, r.text
    page = _wait_idle(http)
    assert _metric(page, "moe_server_requests_cancelled_total") == _metric(
        before, "moe_server_requests_cancelled_total") + 1
    # the dropped generation was stopped, not run to LONG tokens
    generated = _metric(page, "moe_server_completion_tokens_total") - _metric(
        before, "moe_server_completion_tokens_total")
    assert generated < LONG, f"{generated} tokens generated after the client left"
    assert time.monotonic() - t0 < 60
