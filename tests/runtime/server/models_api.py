"""The router's ``/models`` API and the page cache, as the router and sleep tests drive them:
each model's status (polled until it is reached, never timed), load and unload, a chat with a
named model, ``/models/sse`` read on a thread, and ``mincore``'s count of a model's experts
in RAM."""
from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import httpx

from gguf_tools.synth import SynthSpec

WAIT_S = 120.0                        # a generous bound for a state to be reached


def small_spec(seed: int) -> SynthSpec:
    return SynthSpec(arch="qwen3moe", layers=4, experts=8, top_k=2, embd=64, ff=32,
                     dtype="f32", seed=seed, skew=1.0)


def statuses(http: httpx.Client, headers: dict | None = None) -> dict[str, dict]:
    r = http.get("/models", headers=headers)
    assert r.status_code == 200, r.text
    return {m["id"]: m for m in r.json()["data"]}


def wait_status(http: httpx.Client, name: str, wanted: set[str],
                headers: dict | None = None) -> dict:
    deadline = time.monotonic() + WAIT_S
    while True:
        model = statuses(http, headers)[name]
        if model["status"]["value"] in wanted:
            return model
        assert time.monotonic() < deadline, f"{name} never reached {wanted}: {model}"
        time.sleep(0.05)


def unload_all(http: httpx.Client, headers: dict | None = None) -> None:
    for name, model in statuses(http, headers).items():
        if model["status"]["value"] != "unloaded":
            http.post("/models/unload", json={"model": name}, headers=headers)
            wait_status(http, name, {"unloaded"}, headers)


def load(http: httpx.Client, name: str, headers: dict | None = None) -> dict:
    r = http.post("/models/load", json={"model": name}, headers=headers)
    assert r.status_code == 200 and r.json() == {"success": True}, r.text
    return wait_status(http, name, {"loaded"}, headers)


def chat(http: httpx.Client, model: str, **extra) -> httpx.Response:
    return http.post("/v1/chat/completions", json={
        "model": model, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4,
        "temperature": 0, **extra})


class Events:
    """``GET /models/sse`` read on a thread: every event, as it comes."""

    def __init__(self, base_url: str) -> None:
        self.seen: list[dict] = []
        self._ready = threading.Event()
        self._client = httpx.Client(base_url=base_url, timeout=None)
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()
        assert self._ready.wait(30), "the event stream did not open"

    def _read(self) -> None:
        try:
            with self._client.stream("GET", "/models/sse") as r:
                self._ready.set()
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        self.seen.append(json.loads(line[6:]))
        except httpx.HTTPError:
            pass                  # closed by close()

    def wait_for(self, model: str, status: str) -> dict:
        deadline = time.monotonic() + WAIT_S
        while True:
            for event in self.seen:
                if event["model"] == model and event.get("data", {}).get("status") == status:
                    return event
            assert time.monotonic() < deadline, f"no {model} {status} event in {self.seen}"
            time.sleep(0.05)

    def close(self) -> None:
        self._client.close()


def resident_expert_bytes(path: Path) -> int:
    """Bytes of ``path``'s routed experts that the page cache holds now (mincore through a
    mapping of our own: it reads nothing)."""
    import mmap

    from gguf_tools.expert_index import ExpertIndex
    from runtime.ramtier.layout import ExpertLayout
    from runtime.ramtier.mapping import FileMapping

    layout = ExpertLayout.from_index(ExpertIndex.open(str(path)))
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) as m:
        pages = FileMapping.find(str(path)).resident_pages()
        del m
    return int(layout.resident_bytes(pages).sum())
