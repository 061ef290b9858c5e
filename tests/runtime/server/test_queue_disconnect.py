"""``serve -np 1 --queue-size 2``: clients that disconnect while waiting leave the queue at
once (they once held their places, and everyone got 429 until the running answer ended), and
each counts once in /metrics as cancelled (499: no status was sent), not as a 503."""
from __future__ import annotations

import re
import threading
import time

import httpx
import pytest

PROMPT = "the king saw a river near the old house and"


@pytest.fixture(scope="module")
def server(start_server, tiny_model):
    return start_server(tiny_model, "-np", "1", "--queue-size", "2", "-c", "16384")


def _metric(page: str, name: str, labels: str = "") -> float:
    match = re.search(rf"^{re.escape(name + labels)} (\S+)$", page, re.M)
    return float(match.group(1)) if match else 0.0


def _wait(http: httpx.Client, name: str, value: float, timeout: float = 10) -> str:
    deadline = time.monotonic() + timeout
    while True:
        page = http.get("/metrics").text
        if _metric(page, name) == value or time.monotonic() > deadline:
            return page
        time.sleep(0.02)


def test_waiting_clients_that_leave_free_their_places(server):
    body = {"prompt": PROMPT, "max_tokens": 16000, "temperature": 0, "stream": True}
    with httpx.Client(base_url=server.base_url, timeout=60) as http:
        before = http.get("/metrics").text
        with http.stream("POST", "/v1/completions", json=body) as running:
            lines = running.iter_lines()
            assert next(line for line in lines if line.startswith("data: "))

            def leave(stream: bool) -> None:      # waits, then gives up after 0.5 s
                try:
                    payload = {"prompt": PROMPT, "max_tokens": 2, "stream": stream}
                    httpx.post(f"{server.base_url}/v1/completions", json=payload, timeout=0.5)
                except httpx.TimeoutException:
                    pass
            leavers = [threading.Thread(target=leave, args=(s,)) for s in (False, True)]
            for t in leavers:
                t.start()
            assert _metric(_wait(http, "moe_server_requests_waiting", 2),
                           "moe_server_requests_waiting") == 2
            for t in leavers:
                t.join()
            page = _wait(http, "moe_server_requests_waiting", 0)
            assert _metric(page, "moe_server_requests_waiting") == 0
            assert _metric(page, "moe_server_requests_running") == 1   # still generating
            # two new clients get their places instead of 429s
            answers: list[httpx.Response] = []
            stayers = [threading.Thread(target=lambda: answers.append(httpx.post(
                f"{server.base_url}/v1/completions", json={"prompt": PROMPT, "max_tokens": 2},
                timeout=120))) for _ in range(2)]
            for t in stayers:
                t.start()
            assert _metric(_wait(http, "moe_server_requests_waiting", 2),
                           "moe_server_requests_waiting") == 2
            assert next(line for line in lines if line.startswith("data: "))
        for t in stayers:                 # the stream was closed: they run now
            t.join()
        assert [a.status_code for a in answers] == [200, 200], [a.text for a in answers]
        page = _wait(http, "moe_server_requests_running", 0)
    gone = _metric(page, "moe_server_requests_cancelled_total") - _metric(
        before, "moe_server_requests_cancelled_total")
    assert gone == 3            # two waiting clients and the stream closed mid-answer
    closed = 'moe_server_requests_total{path="/v1/completions",status="499"}'
    assert _metric(page, closed) - _metric(before, closed) == 1    # the non-streamed waiter
    statuses = re.findall(r'path="/v1/completions",status="(\d+)"', page)
    assert sorted(statuses) == ["200", "499"], statuses     # no 503, 500 or 429
    assert httpx.get(f"{server.base_url}/health", timeout=10).json()["status"] == "ok"
