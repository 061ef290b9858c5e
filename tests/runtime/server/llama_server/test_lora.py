"""LoRA adapters as llama-server serves them, on the real server with a synthetic adapter
(attention and output weights of the synthetic model): ``GET|POST /lora-adapters``, a
request's ``"lora"`` field; scale 0 gives the base model's greedy text and a nonzero scale
changes it; bad ids and scales are 400s whose message starts ``lora``; an adapter of routed
experts, or --lora with -np > 1, is refused before the server listens."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import httpx
import openai
import pytest

from gguf_tools.synth_adapters import write_synthetic_lora
from tests.runtime.server.conftest import REPO_ROOT

PROMPT = "the king saw a river near the"


@pytest.fixture(scope="module")
def adapter(tmp_path_factory, tiny_spec) -> Path:
    return write_synthetic_lora(tmp_path_factory.mktemp("lora") / "lora.gguf", tiny_spec)


@pytest.fixture(scope="module")
def base_http(start_server, tiny_model):
    server = start_server(tiny_model, "--temp", "0", "-n", "16")
    with httpx.Client(base_url=server.base_url, timeout=60) as client:
        yield client


@pytest.fixture(scope="module")
def lora_server(start_server, tiny_model, adapter):
    return start_server(tiny_model, "--temp", "0", "-n", "16", "--lora", str(adapter))


@pytest.fixture(scope="module")
def http(lora_server):
    with httpx.Client(base_url=lora_server.base_url, timeout=60) as client:
        yield client


def text(http: httpx.Client, **extra) -> str:
    r = http.post("/completion", json={"prompt": PROMPT, "ignore_eos": True} | extra)
    assert r.status_code == 200, r.text
    return r.json()["content"]


def test_scale_zero_is_the_base_model_and_a_scale_changes_it(http, base_http, adapter):
    base = text(base_http)
    assert http.get("/lora-adapters").json() == [
        {"id": 0, "path": str(adapter), "scale": 1.0, "task_name": "", "prompt_prefix": ""}]
    adapted = text(http)                                  # --lora: scale 1
    assert adapted != base
    assert text(http, lora=[{"id": 0, "scale": 0.0}]) == base
    assert text(http, lora=[]) == base                    # adapters not named: 0
    assert text(http) == adapted                          # back to the global scale
    r = http.post("/completion", json={"prompt": PROMPT, "lora": [{"id": 0, "scale": 0.5}]})
    assert r.json()["generation_settings"]["lora"] == [{"id": 0, "scale": 0.5}]
    assert http.post("/lora-adapters", json=[{"id": 0, "scale": 0.0}]).json() == {"success": True}
    assert http.get("/lora-adapters").json()[0]["scale"] == 0.0
    assert text(http) == base
    assert text(http, lora=[{"id": 0, "scale": 1.0}]) == adapted
    http.post("/lora-adapters", json=[])                  # llama-server: not named -> 0
    assert http.get("/lora-adapters").json()[0]["scale"] == 0.0
    http.post("/lora-adapters", json=[{"id": 0, "scale": 1.0}])
    assert text(http) == adapted


def test_chat_takes_a_requests_lora(lora_server, base_http):
    def chat(base_url: str, **extra) -> str:
        client = openai.OpenAI(base_url=f"{base_url.rstrip('/')}/v1", api_key="x",
                               max_retries=0)
        answer = client.chat.completions.create(
            model="any", messages=[{"role": "user", "content": "hello"}], max_tokens=12,
            temperature=0, extra_body=extra or None)
        return answer.choices[0].message.content
    base = chat(str(base_http.base_url))
    assert chat(lora_server.base_url, lora=[{"id": 0, "scale": 0.0}]) == base


@pytest.mark.parametrize("lora", [
    [{"id": 1, "scale": 1.0}], [{"id": -1, "scale": 1.0}], [{"id": "0", "scale": 1.0}],
    [{"id": 0, "scale": "big"}], [{"id": 0}], [{"id": 0, "scale": 1.0, "x": 1}],
    [{"id": 0, "scale": 1.0}, {"id": 0, "scale": 0.5}], {"id": 0, "scale": 1.0}, [0],
])
def test_bad_lora_is_a_400_naming_it(http, lora):
    for path, body in (("/completion", {"prompt": PROMPT}),
                       ("/v1/completions", {"prompt": PROMPT}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]})):
        r = http.post(path, json=body | {"lora": lora})
        assert r.status_code == 400, (path, r.text)      # llama-server's shape: no param
        assert r.json()["error"]["message"].startswith("lora"), (path, r.text)
    if isinstance(lora, list):
        r = http.post("/lora-adapters", json=lora)
        assert r.status_code == 400 and "lora" in r.json()["error"]["message"]


def test_post_wants_an_array(http):
    r = http.post("/lora-adapters", json={"id": 0, "scale": 1.0})
    assert r.status_code == 400
    assert r.json()["error"]["message"] == "Request body must be an array"


def test_without_adapters(base_http):
    assert base_http.get("/lora-adapters").json() == []
    assert base_http.post("/lora-adapters", json=[]).json() == {"success": True}
    r = base_http.post("/completion", json={"prompt": PROMPT, "lora": [{"id": 0, "scale": 1}]})
    assert r.status_code == 400 and "--lora" in r.json()["error"]["message"]


def _serve(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "runtime.cli", "serve", "--port", "0", *args],
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=120,
                          stdin=subprocess.DEVNULL)


def test_refused_before_listening(tmp_path, tiny_model, tiny_spec, adapter):
    experts = write_synthetic_lora(tmp_path / "experts.gguf", tiny_spec,
                                   targets=("ffn_up_exps",))
    for args, needle in (
            (("--lora", str(experts)), "routed-expert weights (blk.0.ffn_up_exps.weight"),
            (("--lora", str(adapter), "-np", "2"), "not with -np > 1"),
            (("--lora-scaled", f"{adapter}:nan"), "want FNAME:SCALE"),
            (("--lora", str(tmp_path / "missing.gguf")), "no such file"),
            (("--tools", "all"), "not served here")):
        result = _serve("-m", str(tiny_model), *args)
        assert result.returncode != 0, args
        assert "Traceback" not in result.stderr and "listening on" not in result.stderr
        assert needle in result.stderr, (args, result.stderr)


def test_scaled_and_init_without_apply(start_server, tiny_model, adapter, base_http):
    server = start_server(tiny_model, "--temp", "0", "-n", "16",
                          "--lora-scaled", f"{adapter}:0.5", "--lora-init-without-apply")
    with httpx.Client(base_url=server.base_url, timeout=60) as http:
        assert http.get("/lora-adapters").json()[0]["scale"] == 0.0
        assert text(http) == text(base_http)
        assert text(http, lora=[{"id": 0, "scale": 0.5}]) != text(base_http)
