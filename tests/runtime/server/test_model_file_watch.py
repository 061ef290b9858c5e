"""The served model file, cut short, rewritten or replaced under the running server (issue 32):
each generation fails with a clean 503 in its route's shape naming the file (before: SIGBUS on
the next request, no log line), the log says so once, /health reports it, the other routes go
on, and once the file is back as it was loaded the next request is served."""
from __future__ import annotations

import json
import os
from pathlib import Path

import anthropic
import httpx
import openai
import pytest

from tests.runtime.server.broken_files import model_copy, restore_bytes, tensor_range

CHANGED = "the model file changed under the running server"
CHAT = [{"role": "user", "content": "tell me about the sea"}]


def _clients(server) -> tuple[openai.OpenAI, anthropic.Anthropic]:
    return (openai.OpenAI(base_url=server.api_url, api_key="x", max_retries=0, timeout=60),
            anthropic.Anthropic(base_url=server.base_url, api_key="x", max_retries=0,
                                timeout=60))


def _assert_refused(server, copy: Path, change: str) -> None:
    """Every generating route: a clean error naming the file; the others answer."""
    client, claude = _clients(server)
    with pytest.raises(openai.APIStatusError) as err:
        client.chat.completions.create(model="x", messages=CHAT, max_tokens=4)
    assert err.value.status_code == 503 and str(copy) in err.value.message
    assert change in err.value.message and err.value.code == "model_file_changed"
    with pytest.raises(openai.APIError, match=CHANGED):      # in-band, in the stream
        for _ in client.completions.create(model="x", prompt="the sea", max_tokens=4,
                                           stream=True):
            pass
    with pytest.raises(anthropic.APIStatusError) as err:
        claude.messages.create(model="x", max_tokens=4, messages=CHAT)
    assert err.value.status_code == 503 and str(copy) in str(err.value)
    native = httpx.post(f"{server.base_url}/completion", json={"prompt": "hi", "n_predict": 2},
                        timeout=60)
    assert native.status_code == 503 and native.json()["error"]["code"] == 503
    health = httpx.get(f"{server.base_url}/health", timeout=10)
    assert health.status_code == 503, health.text
    assert health.json()["status"] == "degraded"
    assert str(copy) in health.json()["degraded"]["model_file"]
    for path in ("/v1/models", "/metrics", "/props"):       # the rest of the server goes on
        assert httpx.get(f"{server.base_url}{path}", timeout=10).status_code == 200
    assert httpx.post(f"{server.base_url}/tokenize", json={"content": "hi"},
                      timeout=10).status_code == 200
    server.assert_alive()


def _assert_serving(server) -> None:
    client, _ = _clients(server)
    answer = client.chat.completions.create(model="x", messages=CHAT, max_tokens=4,
                                            temperature=0)
    assert answer.usage.completion_tokens > 0
    assert httpx.get(f"{server.base_url}/health", timeout=10).json() == {"status": "ok"}


@pytest.mark.parametrize("flags, cut_in", [
    ((), "blk.1.attn_q.weight"),                              # the dense weights (mapped)
    (("--no-residency",), "blk.3.ffn_down_exps.weight"),      # anywhere: llama.cpp's own mmap
    (("-np", "2"), "token_embd.weight"),                      # the batch scheduler's path
    (("--devices.cpu", "200KiB"), "blk.2.ffn_up_exps.weight"),   # the RAM tier's experts
], ids=["dense", "no-residency", "np2", "ram-tier"])
def test_a_truncated_model_file_fails_requests_cleanly(start_server, tiny_model, tmp_path,
                                                       flags, cut_in):
    copy = model_copy(tiny_model, tmp_path)
    server = start_server(copy, "-c", "512", *flags)
    _assert_serving(server)
    loaded = copy.stat()
    offset, nbytes = tensor_range(copy, cut_in)
    os.truncate(copy, offset + nbytes // 2)
    _assert_refused(server, copy, "truncated to")
    _assert_refused(server, copy, "truncated to")            # again: no state left behind
    logged = [line for line in server.log().splitlines() if CHANGED in line]
    assert len(logged) == 1 and str(copy) in logged[0], server.log()
    restore_bytes(copy, tiny_model, loaded)                  # back as loaded (cp -p)
    _assert_serving(server)


def test_a_rewritten_or_replaced_model_file(start_server, tiny_model, tmp_path):
    copy = model_copy(tiny_model, tmp_path)
    server = start_server(copy, "-c", "512")
    loaded = copy.stat()
    os.utime(copy, ns=(loaded.st_atime_ns, loaded.st_mtime_ns + 10**9))   # written in place
    _assert_refused(server, copy, "rewritten in place")
    os.utime(copy, ns=(loaded.st_atime_ns, loaded.st_mtime_ns))           # as it was
    _assert_serving(server)
    (tmp_path / "new").mkdir()
    os.replace(model_copy(tiny_model, tmp_path / "new"), copy)   # the same bytes, a new file
    _assert_refused(server, copy, "replaced")
    logged = [line for line in server.log().splitlines() if CHANGED in line]
    assert len(logged) == 2, server.log()                     # one line per change


def test_a_file_cut_while_the_server_reads_it(start_server, tiny_model, tmp_path):
    """The cut lands during a batch (a 2000-token prompt's, seconds long here, cut as its
    first progress event comes, in the last layer's attention, read by every ubatch), not
    between requests: before the lease, llama.cpp read past the new end and the server died
    of SIGBUS."""
    copy = model_copy(tiny_model, tmp_path)
    server = start_server(copy, "-c", "4096", "-b", "2048")
    loaded = copy.stat()
    offset, nbytes = tensor_range(copy, "blk.3.attn_q.weight")
    body = {"prompt": "the sea " * 1000, "n_predict": 4, "stream": True,
            "return_progress": True}
    with httpx.stream("POST", f"{server.base_url}/completion", json=body, timeout=120) as r:
        events = []
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(json.loads(line[6:]))
                if len(events) == 1:              # the prompt's batch starts now: cut
                    assert "prompt_progress" in events[0], events[0]
                    os.truncate(copy, offset + nbytes // 2)
    assert CHANGED in events[-1]["error"]["message"], events[-1]
    server.assert_alive()
    _assert_refused(server, copy, "truncated to")
    restore_bytes(copy, tiny_model, loaded)
    _assert_serving(server)
