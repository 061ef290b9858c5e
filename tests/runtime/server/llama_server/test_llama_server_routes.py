"""llama-server's own routes on the real server: shapes as llama.cpp's tools/server answers
them (native completion streamed and not, tokenize/detokenize, apply-template, props, slots,
infill), and llama-server's error shape there."""
from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

N_CTX = 512
PROMPT = "the king saw a river near the old house and"


@pytest.fixture(scope="module")
def server(start_server, tiny_model: Path):
    return start_server(tiny_model, "-c", str(N_CTX), "--temp", "0", "-s", "42")


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.base_url, timeout=60) as client:
        yield client


def test_native_completion_shape_and_stream(http):
    r = http.post("/completion", json={"prompt": PROMPT, "n_predict": 8, "return_tokens": True,
                                       "n_probs": 2})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["stop"] is True and body["stop_type"] == "limit" and body["truncated"] is False
    assert body["tokens_predicted"] == 8 == body["timings"]["predicted_n"] == len(body["tokens"])
    assert body["timings"]["prompt_n"] >= 0 and isinstance(body["has_new_line"], bool)
    assert body["generation_settings"]["seed"] == 42
    assert body["generation_settings"]["n_predict"] == 8
    assert len(body["completion_probabilities"]) == 8
    assert all(len(p["top_logprobs"]) == 2 for p in body["completion_probabilities"])
    streamed, last = "", None
    with http.stream("POST", "/completions", json={"prompt": PROMPT, "n_predict": 8,
                                                   "stream": True}) as s:
        for line in s.iter_lines():
            if line.startswith("data: "):
                event = json.loads(line[6:])
                assert isinstance(event["stop"], bool)
                if event["stop"]:
                    last = event
                else:
                    assert len(event["tokens"]) == 1
                    streamed += event["content"]
    assert last is not None and last["stop_type"] == "limit" and last["timings"]["predicted_n"] == 8
    assert streamed == body["content"]         # greedy: same text streamed or not


def test_tokenize_detokenize_and_pieces(http):
    text = "What is the capital of France ?"
    tokens = http.post("/tokenize", json={"content": text}).json()["tokens"]
    assert len(tokens) > 5 and all(isinstance(t, int) for t in tokens)
    assert http.post("/detokenize", json={"tokens": tokens}).json()["content"].strip() == text
    with_bos = http.post("/tokenize", json={"content": text, "add_special": True}).json()
    assert with_bos["tokens"][0] == 1 and with_bos["tokens"][1:] == tokens
    pieces = http.post("/tokenize", json={"content": "emoji 🤗", "with_pieces": True}).json()
    assert all({"id", "piece"} <= set(p) for p in pieces["tokens"])
    r = http.post("/detokenize", json={"tokens": [10**9]})
    assert r.status_code == 400 and r.json()["error"]["code"] == 400   # llama-server's shape


def test_apply_template_props_slots(http):
    prompt = http.post("/apply-template", json={"messages": [
        {"role": "user", "content": "hi"}]}).json()["prompt"]
    assert prompt == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    props = http.get("/props").json()
    assert props["total_slots"] == 1 and props["model_path"].endswith(".gguf")
    assert props["default_generation_settings"]["n_ctx"] == N_CTX
    assert props["default_generation_settings"]["params"]["temperature"] == 0
    slots = http.get("/slots").json()
    assert len(slots) == 1 and slots[0]["n_ctx"] == N_CTX and "is_processing" in slots[0]


def test_infill_without_fim_tokens_is_a_clear_400(http):
    r = http.post("/infill", json={"input_prefix": "def f(", "input_suffix": ")"})
    assert r.status_code == 400
    assert "fill-in-the-middle" in r.json()["error"]["message"]


def test_unsupported_native_field_is_a_400_naming_it(http):
    r = http.post("/completion", json={"prompt": PROMPT, "mirostat": 2})
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["code"] == 400 and "mirostat" in error["message"]


def test_no_slots_flag_and_a_builtin_chat_template(start_server, tiny_model):
    server = start_server(tiny_model, "--no-slots", "--chat-template", "llama3")
    r = httpx.get(f"{server.base_url}/slots", timeout=30)
    assert r.status_code == 501 and "error" in r.json()
    prompt = httpx.post(f"{server.base_url}/apply-template", timeout=30, json={
        "messages": [{"role": "user", "content": "hi"}]}).json()["prompt"]
    assert prompt.endswith("<|start_header_id|>user<|end_header_id|>\n\nhi<|eot_id|>"
                           "<|start_header_id|>assistant<|end_header_id|>\n\n")


def test_infill_on_a_model_with_fim_tokens(start_server, tiny_model, tmp_path):
    import subprocess
    import sys

    fim_model = tmp_path / "fim.gguf"        # the tiny model, with three tokens named FIM
    subprocess.run([sys.executable, "-m", "gguf.scripts.gguf_new_metadata", str(tiny_model),
                    str(fim_model), "--special-token-by-id", "fim_pre", "3",
                    "--special-token-by-id", "fim_suf", "4", "--special-token-by-id",
                    "fim_mid", "0", "--force"], check=True, capture_output=True)
    server = start_server(fim_model, "--temp", "0")
    with httpx.Client(base_url=server.base_url, timeout=60) as http:
        prefix, suffix = "def add(a, b):\n    return ", "\n"
        n_prefix = len(http.post("/tokenize", json={"content": prefix}).json()["tokens"])
        n_suffix = len(http.post("/tokenize", json={"content": suffix}).json()["tokens"])
        r = http.post("/infill", json={"input_prefix": prefix, "input_suffix": suffix,
                                       "n_predict": 5})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["tokens_evaluated"] == n_prefix + n_suffix + 3   # + FIM pre, suf, mid
        assert body["tokens_predicted"] <= 5 and body["stop"] is True
        r = http.post("/infill", json={"input_prefix": prefix, "input_extra": [{"text": "x"}]})
        assert r.status_code == 400 and "input_extra" in r.json()["error"]["message"]
