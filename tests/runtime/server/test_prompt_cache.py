"""``--cache-ram`` on the real server: a prompt whose slot another request took comes back
from host memory (``cache_n`` > 0) and answers exactly as it did the first time; without the
flag it is evaluated again. A q8_0 model: greedy answers can be compared token for token."""
from __future__ import annotations

import httpx
import pytest

from gguf_tools.synth import SynthSpec

SPEC = SynthSpec(arch="qwen3moe", layers=4, experts=8, top_k=2, embd=128, ff=64,
                 dtype="q8_0", seed=3, skew=1.0)
LONG = "the king saw a river near the old house and the queen sang a song of the sea " * 3
OTHER = "a dog ran"


def _complete(http: httpx.Client, prompt: str, **extra) -> dict:
    r = http.post("/completion", json={"prompt": prompt, "n_predict": 8, "temperature": 0,
                                       "cache_prompt": True} | extra)
    assert r.status_code == 200, r.text
    return r.json()


@pytest.mark.parametrize("extra", [("-np", "1"), ("-np", "2", "--kv-unified")],
                         ids=["np1", "np2-unified"])
def test_a_prompt_returns_from_host_memory(start_server, synth_model_factory, extra):
    server = start_server(synth_model_factory(SPEC), "--cache-ram", "64", "-c", "1024",
                          "-v", *extra)
    with httpx.Client(base_url=server.base_url, timeout=120) as http:
        first = _complete(http, LONG, id_slot=0)
        n_prompt = first["timings"]["prompt_n"]
        _complete(http, OTHER, id_slot=0)           # takes slot 0: LONG goes to host memory
        again = _complete(http, LONG)
    assert again["timings"]["cache_n"] >= n_prompt - 1
    assert again["timings"]["prompt_n"] < n_prompt
    assert again["tokens"] == first["tokens"] and again["content"] == first["content"]
    log = server.log()
    assert "updating prompt cache" in log and "loaded a cached prompt" in log


def test_an_idle_slot_is_saved_when_a_request_starts(start_server, synth_model_factory):
    # -np 2 with one KV pool: a request on slot 1 copies idle slot 0 to host memory and
    # empties it; the prompt comes back from there
    server = start_server(synth_model_factory(SPEC), "--cache-ram", "64", "-c", "1024",
                          "-np", "2", "--kv-unified", "-v")
    with httpx.Client(base_url=server.base_url, timeout=120) as http:
        first = _complete(http, LONG, id_slot=0)
        assert "idle slot saved" not in server.log()    # slot 1 holds nothing
        _complete(http, OTHER, id_slot=1)
        assert "slot 0: idle slot saved" in server.log()
        slots = http.get("/slots").json()
        again = _complete(http, LONG)
    assert again["timings"]["cache_n"] >= first["timings"]["prompt_n"] - 1
    assert again["tokens"] == first["tokens"]
    assert len(slots) == 2


def test_without_cache_ram_the_prompt_is_evaluated_again(start_server, synth_model_factory):
    server = start_server(synth_model_factory(SPEC), "-c", "1024")
    with httpx.Client(base_url=server.base_url, timeout=120) as http:
        first = _complete(http, LONG)
        _complete(http, OTHER)
        again = _complete(http, LONG)
    assert again["timings"]["cache_n"] <= 1     # at most a shared first token
    assert again["tokens"] == first["tokens"]


def test_cache_ram_is_checked(start_server, synth_model_factory, tmp_path):
    import subprocess
    import sys

    from tests.runtime.server.conftest import REPO_ROOT
    out = subprocess.run([sys.executable, "-m", "runtime.cli", "serve", "-m",
                          str(synth_model_factory(SPEC)), "--cache-ram", "-5"],
                         cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode != 0 and "--cache-ram" in out.stderr
    assert "Traceback" not in out.stderr
