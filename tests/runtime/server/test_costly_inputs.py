"""No request starves the others (issue 32): every costly input has a limit or a place in a
queue, checked before the work it bounds. Stop strings are capped (1.3M of them once turned
another slot's 0.1 s answer into 30 s); /tokenize and /detokenize are capped and run on the
bounded side pool (one 16.5 MB /tokenize once took 65 s and 1.8 GB); a request takes its queue
place before its schema is prepared (40 chats with a 20k-item enum were all prepared before 34
got 429); slot actions wait in the generation queue, not on the event loop's threads (45 saves
on a busy slot once held every pooled thread). After each, a normal request succeeds.
The real ``serve`` on the synthetic model; no timed assertions."""
from __future__ import annotations

import json
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.runtime.server.error_shapes import error_of

USER = [{"role": "user", "content": "hi"}]
LONG = {"prompt": "Once upon a time", "n_predict": 4000, "ignore_eos": True, "stream": True}


def _normal_request_succeeds(server) -> None:
    r = httpx.post(f"{server.base_url}/v1/chat/completions",
                   json={"messages": USER, "max_tokens": 2}, timeout=60)
    assert r.status_code == 200, r.text
    assert httpx.get(f"{server.base_url}/health", timeout=10).status_code == 200


def _refused(server, path: str, body: dict, words: str) -> dict:
    r = httpx.post(f"{server.base_url}{path}", json=body, timeout=60)
    err = error_of(r, path)
    assert r.status_code == 400 and words in err["message"], err
    return err


@pytest.fixture(scope="module")
def server(start_server, tiny_model):
    return start_server(tiny_model, "--max-tokenize-kib", "64", "--max-detokenize-tokens",
                        "1000")


def test_stop_strings_past_the_caps_are_refused_before_any_work(server):
    many = ["a"] * 100_000
    _refused(server, "/v1/chat/completions", {"messages": USER, "stop": many},
             "--max-stop-strings")
    _refused(server, "/completion", {"prompt": "hi", "stop": many}, "--max-stop-strings")
    _refused(server, "/v1/messages", {"model": "m", "max_tokens": 2, "messages": USER,
                                      "stop_sequences": ["a"] * 65}, "--max-stop-strings")
    _refused(server, "/v1/completions", {"prompt": "hi", "stop": ["é" * 2049]},
             "--max-stop-bytes")
    at_the_caps = [f"{i:02d}" + "z" * 62 for i in range(64)]          # 64 strings, 4096 bytes
    r = httpx.post(f"{server.base_url}/completion", json={"prompt": "hi", "n_predict": 2,
                                                          "stop": at_the_caps}, timeout=60)
    assert r.status_code == 200, r.text
    _normal_request_succeeds(server)


def test_tokenize_and_detokenize_sizes_are_capped(server):
    text = "word " * (64 * 1024 // 5)
    r = httpx.post(f"{server.base_url}/tokenize", json={"content": text, "with_pieces": True},
                   timeout=60)
    assert r.status_code == 200 and len(r.json()["tokens"]) > 1000, r.text
    _refused(server, "/tokenize", {"content": "x" * (64 * 1024 + 1)}, "--max-tokenize-kib")
    assert httpx.post(f"{server.base_url}/detokenize", json={"tokens": [5] * 1000},
                      timeout=60).status_code == 200
    _refused(server, "/detokenize", {"tokens": [5] * 1001}, "--max-detokenize-tokens")
    _normal_request_succeeds(server)


def test_the_side_pool_refuses_past_its_waiting_places(start_server, tiny_model):
    """One side thread, one waiting place: while a long tokenization holds the thread and
    another request waits for it, a third gets 429 (llama-server's shape, Retry-After)
    instead of piling up; /metrics shows the pool."""
    server = start_server(tiny_model, "--threads-http", "1", "--queue-size", "1")
    long_body = {"content": "word " * (1000 * 1024 // 5), "with_pieces": True}
    with ThreadPoolExecutor(2) as pool:
        long = pool.submit(httpx.post, f"{server.base_url}/tokenize", json=long_body,
                           timeout=120)
        _until_gauge(server, "moe_server_side_work_running", 1)
        second = pool.submit(httpx.post, f"{server.base_url}/tokenize",
                             json={"content": "hi"}, timeout=120)
        _until_gauge(server, "moe_server_side_work_waiting", 1)
        busy = httpx.post(f"{server.base_url}/tokenize", json={"content": "hi"}, timeout=60)
        assert busy.status_code == 429 and busy.headers["retry-after"] == "1", busy.text
        assert "busy" in error_of(busy, "/tokenize")["message"]
        assert long.result().status_code == 200 and second.result().status_code == 200
    _normal_request_succeeds(server)


def _gauge(server, name: str) -> int:
    page = httpx.get(f"{server.base_url}/metrics", timeout=30).text
    return int(float(re.search(rf"^{name} (\S+)$", page, re.M).group(1)))


def _until_gauge(server, name: str, value: int) -> None:
    deadline = time.monotonic() + 60
    while _gauge(server, name) < value:
        assert time.monotonic() < deadline, f"{name} never reached {value}"
        time.sleep(0.02)


class _Stream:
    """A long streamed /completion held open on a thread until ``close()``."""

    def __init__(self, server, **fields) -> None:
        self.started, self.stop = threading.Event(), threading.Event()
        self.status: int | None = None
        self._thread = threading.Thread(target=self._run, args=(server, LONG | fields),
                                        daemon=True)
        self._thread.start()

    def _run(self, server, body: dict) -> None:
        with httpx.stream("POST", f"{server.base_url}/completion", json=body,
                          timeout=120) as r:
            self.status = r.status_code
            for _ in r.iter_lines():
                self.started.set()
                if self.stop.is_set():
                    break
        self.started.set()

    def close(self) -> None:
        self.stop.set()
        self._thread.join(60)


def test_a_schema_is_prepared_only_in_a_queue_place(start_server, tiny_model):
    """With the queue full, a chat whose schema cannot even be converted gets 429, not 400:
    the place is taken before the preparation runs (it was 400 after preparing, then)."""
    server = start_server(tiny_model, "--queue-size", "1")
    running = _Stream(server)
    assert running.started.wait(60) and running.status == 200
    waiting = _Stream(server)
    _until_gauge(server, "moe_server_requests_waiting", 1)
    enum = {"type": "string", "enum": [f"item{i}" for i in range(5000)]}
    for schema in ({"type": "nope"}, enum):
        r = httpx.post(f"{server.base_url}/v1/chat/completions", timeout=60, json={
            "messages": USER, "max_tokens": 2, "response_format": {
                "type": "json_schema", "json_schema": {"name": "s", "schema": schema}}})
        assert r.status_code == 429, r.text
        assert error_of(r, "/v1/chat/completions")["code"] == "queue_full"
    # the side pool and the event loop are free meanwhile
    assert httpx.post(f"{server.base_url}/tokenize", json={"content": "hi"},
                      timeout=30).status_code == 200
    running.close()
    waiting.close()
    _normal_request_succeeds(server)


def test_slot_actions_wait_in_the_generation_queue(start_server, tiny_model, tmp_path):
    """Saves of a busy slot wait for it in the queue (its bound holds: 429 past it) while the
    other routes answer; once the slot is idle the accepted saves are done."""
    server = start_server(tiny_model, "-np", "2", "--queue-size", "1",
                          "--slot-save-path", str(tmp_path))
    busy = _Stream(server, id_slot=0)
    assert busy.started.wait(60) and busy.status == 200

    def save(i):
        return httpx.post(f"{server.base_url}/slots/0?action=save",
                          json={"filename": f"s{i}.bin"}, timeout=120)

    with ThreadPoolExecutor(5) as pool:
        saves = [pool.submit(save, i) for i in range(5)]
        deadline = time.monotonic() + 60     # one runs (waiting for the slot), one waits
        while sum(f.done() for f in saves) < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        refused = [f.result() for f in saves if f.done()]
        assert refused and all(r.status_code == 429 for r in refused), \
            [(r.status_code, r.text) for r in refused]
        assert "queue" in error_of(refused[0], "/slots/0")["message"]
        for path, body in (("/tokenize", {"content": "hi"}), ("/apply-template",
                                                              {"messages": USER})):
            assert httpx.post(f"{server.base_url}{path}", json=body,
                              timeout=30).status_code == 200
        busy.close()
        answers = [f.result() for f in saves]
    saved = [json.loads(r.text) for r in answers if r.status_code == 200]
    assert saved and all(s["n_saved"] > 0 for s in saved), [r.text for r in answers]
    _normal_request_succeeds(server)
