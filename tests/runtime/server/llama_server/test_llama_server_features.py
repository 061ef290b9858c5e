"""llama-server features on the real server (``-np 2``): chat template variables
(``--reasoning``, ``chat_template_kwargs``), the end of the prompt (``add_generation_prompt``,
``continue_final_message``), per-request ``verbose``, a slot's KV prefix reused by the next
request (``cache_n``), several prompts in one ``/completion``, ``response_fields``,
``post_sampling_probs``, timings, an answer that stops at the end of the context, and the
``--no-metrics`` / ``--tags`` flags. A q8_0 model: a batched row computes exactly what a
single row does, so greedy answers can be compared."""
from __future__ import annotations

import json
import math
from pathlib import Path

import httpx
import pytest

from gguf_tools.synth import SynthSpec

SPEC = SynthSpec(arch="qwen3moe", layers=4, experts=8, top_k=2, embd=128, ff=64,
                 dtype="q8_0", seed=3, skew=1.0)
N_CTX = 1280             # two slots
N_BATCH = 32             # tokens per prompt batch
PROMPT = "the king saw a river near the old house and"
# a DeepSeek-R1-like ending: the thinking block is closed when enable_thinking is false
TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|><think>\n"
            "{% if not enable_thinking %}</think>{% endif %}{% endif %}")


@pytest.fixture(scope="module")
def server(start_server, synth_model_factory, tmp_path_factory):
    template = tmp_path_factory.mktemp("template") / "think.jinja"
    template.write_text(TEMPLATE)
    return start_server(synth_model_factory(SPEC), "-c", str(N_CTX), "-np", "2", "--temp", "0",
                        "-b", str(N_BATCH),
                        "-s", "7", "--reasoning", "off", "--chat-template-file", str(template),
                        "--no-metrics", "--tags", "chat,small")


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.base_url, timeout=120) as client:
        yield client


def _apply(http, **extra) -> str:
    r = http.post("/apply-template", json={"messages": [{"role": "user", "content": "hi"}]}
                  | extra)
    assert r.status_code == 200, r.text
    return r.json()["prompt"]


def test_reasoning_off_and_chat_template_kwargs(http):
    assert _apply(http).endswith("<|assistant|><think>\n</think>")          # --reasoning off
    opened = _apply(http, chat_template_kwargs={"enable_thinking": True})  # the request wins
    assert opened.endswith("<|assistant|><think>\n")
    r = http.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "verbose": True,
        "chat_template_kwargs": {"enable_thinking": True}})
    assert r.status_code == 200, r.text
    assert r.json()["__verbose"]["prompt"] == opened


def test_prompt_end_fields_and_verbose(http):
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Wh"}]

    def prompt(**extra) -> str:
        r = http.post("/chat/completions", json={"messages": messages, "max_tokens": 1,
                                                 "verbose": True} | extra)
        assert r.status_code == 200, r.text
        return r.json()["__verbose"]["prompt"]

    assert prompt().endswith("<|assistant|>Wh")                   # a prefill is continued
    assert prompt(continue_final_message=True) == prompt()
    assert prompt(add_generation_prompt=True).endswith("Wh<|assistant|><think>\n</think>")
    r = http.post("/chat/completions", json={"messages": messages, "max_tokens": 1,
                                             "add_generation_prompt": True,
                                             "continue_final_message": True})
    assert r.status_code == 400 and "continue_final_message" in r.json()["error"]["message"]
    r = http.post("/chat/completions", json={"messages": messages[:1], "max_tokens": 1})
    assert "__verbose" not in r.json()


def test_a_slot_reuses_its_kv_prefix(http):
    body = {"prompt": PROMPT + " once more", "n_predict": 6}
    first = http.post("/completion", json=body).json()
    again = http.post("/completion", json=body).json()
    n_prompt = first["tokens_evaluated"]
    assert first["timings"]["cache_n"] + first["timings"]["prompt_n"] == n_prompt
    # the same prompt again: only its last token is evaluated (for the logits to sample)
    assert again["timings"] == again["timings"] | {"cache_n": n_prompt - 1, "prompt_n": 1}
    assert again["content"] == first["content"]                 # greedy: the same answer
    longer = http.post("/completion", json={"prompt": PROMPT + " once more and again",
                                            "n_predict": 2}).json()
    assert longer["timings"]["cache_n"] >= n_prompt - 1          # the shared prefix
    r = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}],
                                                "max_tokens": 2})
    r = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}],
                                                "max_tokens": 2})
    assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0


def test_several_prompts_answer_a_list(http):
    tokens = http.post("/tokenize", json={"content": PROMPT, "add_special": True}).json()["tokens"]
    r = http.post("/completion", json={"prompt": [tokens, PROMPT, {"prompt_string": PROMPT}],
                                       "n_predict": 4})
    assert r.status_code == 200, r.text
    answers = r.json()
    assert [a["index"] for a in answers] == [0, 1, 2]
    assert len({a["content"] for a in answers}) == 1               # the same prompt, greedy
    one = http.post("/completion", json={"prompt": tokens, "n_predict": 4}).json()
    assert isinstance(one, dict) and one["content"] == answers[0]["content"]
    r = http.post("/completion", json={"prompt": [tokens, PROMPT], "stream": True})
    assert r.status_code == 400 and r.json()["error"]["code"] == 400


def test_response_fields(http):
    r = http.post("/completion", json={"prompt": PROMPT, "n_predict": 3, "response_fields": [
        "content", "generation_settings/n_predict", "timings/predicted_n", "no/such"]})
    assert r.status_code == 200, r.text
    body = r.json()
    assert set(body) == {"content", "generation_settings/n_predict", "timings/predicted_n"}
    assert body["generation_settings/n_predict"] == 3 == body["timings/predicted_n"]


def test_post_sampling_probs_pick_the_same_tokens(http):
    body = {"prompt": PROMPT, "n_predict": 6, "temperature": 1.0, "seed": 11, "n_probs": 5,
            "return_tokens": True}
    raw = http.post("/completion", json=body).json()
    post = http.post("/completion", json=body | {"post_sampling_probs": True}).json()
    assert post["tokens"] == raw["tokens"]          # the same seeded chain, the same picks
    for entry in post["completion_probabilities"]:
        assert 0.0 < entry["prob"] <= 1.0 and "logprob" not in entry
        probs = [p["prob"] for p in entry["top_probs"]]
        assert 1 <= len(probs) <= 5 and probs == sorted(probs, reverse=True)
        assert all(0.0 < p <= 1.0 for p in probs) and sum(probs) <= 1.0 + 1e-5
    for entry in raw["completion_probabilities"]:
        assert entry["logprob"] <= 0.0 and len(entry["top_logprobs"]) == 5
    greedy = http.post("/completion", json=body | {"temperature": 0,
                                                   "post_sampling_probs": True}).json()
    # llama-server's greedy chain with n_probs: the n highest logits share a softmax
    assert all(len(e["top_probs"]) == 5 and e["prob"] == e["top_probs"][0]["prob"]
               for e in greedy["completion_probabilities"])


def test_timings(http):
    t = http.post("/completion", json={"prompt": PROMPT, "n_predict": 8}).json()["timings"]
    assert t["predicted_n"] == 8
    # the first token comes from the prompt's logits: the rate is over 7 decode steps
    assert math.isclose(t["predicted_per_second"], 7e3 / t["predicted_ms"])
    one = http.post("/completion", json={"prompt": PROMPT, "n_predict": 1}).json()["timings"]
    assert one["predicted_per_second"] == 0.0 == one["predicted_per_token_ms"]
    frames = []
    with http.stream("POST", "/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "stream": True,
            "stream_options": {"include_usage": True}, "timings_per_token": True}) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                frames.append(json.loads(line[6:]))
    usage = [f for f in frames if not f["choices"]]
    assert len(usage) == 1 and usage[0]["timings"]["predicted_n"] == 4
    assert "timings" not in frames[0]


def test_answer_stops_at_the_end_of_the_context(http):
    n_slot = http.get("/props").json()["default_generation_settings"]["n_ctx"]   # a slot's
    assert n_slot >= N_CTX // 2                      # (llama.cpp may round the context up)
    r = http.post("/completion", json={"prompt": PROMPT, "n_predict": 4 * n_slot,
                                       "ignore_eos": True})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["tokens_evaluated"] + body["tokens_predicted"] == n_slot
    assert body["truncated"] is True and body["stop_type"] == "limit"
    r = http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 4 * n_slot,
                                           "logit_bias": {}})
    assert r.status_code == 200 and r.json()["usage"]["total_tokens"] <= n_slot
    r = http.post("/completion", json={"prompt": "word " * (2 * n_slot)})
    assert r.status_code == 400 and r.json()["error"]["type"] == "exceed_context_size_error"


def test_no_metrics_and_tags(http):
    r = http.get("/metrics")
    assert r.status_code == 501 and r.json()["error"]["type"] == "not_supported_error"
    assert http.get("/v1/models").json()["data"][0]["tags"] == ["chat", "small"]
    r = http.post("/slots/0?action=erase")          # no --slot-save-path
    assert r.status_code == 501 and r.json()["error"]["type"] == "not_supported_error"


def test_kv_unified_lets_one_slot_use_the_whole_pool(start_server, synth_model_factory):
    from concurrent.futures import ThreadPoolExecutor

    server = start_server(synth_model_factory(SPEC), "-c", "128", "-np", "2", "--kv-unified",
                          "--temp", "0")
    with httpx.Client(base_url=server.base_url, timeout=120) as http:
        n_pool = http.get("/props").json()["default_generation_settings"]["n_ctx"]
        assert n_pool >= 128                    # the whole pool (llama.cpp may round it up)
        n = n_pool - 8
        body = {"prompt": "A", "n_predict": n, "ignore_eos": True}
        r = http.post("/completion", json=body)
        assert r.status_code == 200 and r.json()["timings"]["predicted_n"] == n   # > pool / 2
        with ThreadPoolExecutor(2) as pool:         # together they need more than the pool
            answers = list(pool.map(lambda _: http.post("/completion", json=body), range(2)))
        for a in answers:       # side by side, the pool is aborted; one after the other, not
            assert (a.status_code == 200 and a.json()["timings"]["predicted_n"] == n) or (
                a.status_code == 500
                and "context size has been exceeded" in a.json()["error"]["message"].lower())
        r = http.post("/completion", json=body)
        assert r.status_code == 200 and r.json()["timings"]["predicted_n"] == n


def _events(http, path: str, body: dict) -> list[dict]:
    with http.stream("POST", path, json=body | {"stream": True}) as r:
        assert r.status_code == 200
        return [json.loads(line[6:]) for line in r.iter_lines()
                if line.startswith("data: ") and line != "data: [DONE]"]


def test_return_progress(http):
    prompt = "the quick brown fox jumps over the lazy dog " * 6     # several batches
    events = _events(http, "/completion", {"prompt": prompt, "n_predict": 2,
                                           "return_progress": True, "timings_per_token": True})
    progress = [e for e in events if "prompt_progress" in e]
    total = progress[0]["prompt_progress"]["total"]
    assert total == events[-1]["tokens_evaluated"]
    steps = [p["prompt_progress"]["processed"] for p in progress]
    cache = progress[0]["prompt_progress"]["cache"]
    # one report before the first batch, then one per batch of at most n_batch tokens
    assert steps[0] == cache and steps[-1] == total and steps == sorted(set(steps))
    assert len(steps) == 1 + -(-(total - cache) // N_BATCH) > 2
    assert progress[0]["timings"]["prompt_n"] == 0 == progress[0]["timings"]["prompt_ms"]
    assert all(e["timings"]["predicted_n"] == e["tokens_predicted"] for e in events
               if e.get("tokens"))
    again = _events(http, "/completion", {"prompt": prompt, "n_predict": 2,
                                          "return_progress": True})
    reports = [e["prompt_progress"] for e in again if "prompt_progress" in e]
    assert [(r["cache"], r["processed"]) for r in reports] == [(total - 1, total - 1),
                                                               (total - 1, total)]
    chat = _events(http, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": prompt}], "max_tokens": 2,
        "return_progress": True})
    chat_progress = [f["prompt_progress"] for f in chat if "prompt_progress" in f]
    assert chat_progress and chat_progress[-1]["processed"] == chat_progress[-1]["total"]
    assert all(not f["choices"] for f in chat if "prompt_progress" in f)


def test_tools_in_play_still_stream_content(http):
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8,
            "tools": [{"type": "function", "function": {"name": "add", "parameters": {
                "type": "object", "properties": {"a": {"type": "integer"}}}}}]}
    r = http.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    whole = r.json()["choices"][0]
    assert whole["finish_reason"] == "length" and not whole["message"].get("tool_calls")
    frames = _events(http, "/v1/chat/completions", body)
    content = [f["choices"][0]["delta"]["content"] for f in frames
               if f["choices"] and f["choices"][0]["delta"].get("content")]
    assert len(content) > 1                      # not held until the end
    assert "".join(content) == whole["message"]["content"]


def test_reasoning_content(http):
    # thinking opened by the template: the answer starts in it (it never closes here)
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 6,
            "chat_template_kwargs": {"enable_thinking": True}}
    plain = http.post("/v1/chat/completions", json=body | {"reasoning_format": "none"}).json()
    text = plain["choices"][0]["message"]["content"]
    assert text and "reasoning_content" not in plain["choices"][0]["message"]
    split = http.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]
    assert split["reasoning_content"] == text and split["content"] == ""
    frames = _events(http, "/v1/chat/completions", body)
    deltas = [f["choices"][0]["delta"] for f in frames if f["choices"]]
    assert "".join(d.get("reasoning_content") or "" for d in deltas) == text
    assert not "".join(d.get("content") or "" for d in deltas)
    closed = http.post("/v1/chat/completions", json=body | {
        "chat_template_kwargs": {"enable_thinking": False}}).json()["choices"][0]["message"]
    assert "reasoning_content" not in closed and closed["content"]     # </think> in the prompt
    r = http.post("/v1/chat/completions", json=body | {"reasoning_format": "legacy"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "reasoning_format"


def test_cache_prompt_false_evaluates_the_whole_prompt(http):
    body = {"prompt": PROMPT + " twice", "n_predict": 2}
    first = http.post("/completion", json=body).json()
    cached = http.post("/completion", json=body).json()["timings"]
    fresh = http.post("/completion", json=body | {"cache_prompt": False}).json()
    assert cached["cache_n"] > 0
    assert fresh["timings"]["cache_n"] == 0
    assert fresh["timings"]["prompt_n"] == first["tokens_evaluated"]
    assert fresh["content"] == first["content"]


def test_slot_save_restore_erase(start_server, synth_model_factory, tmp_path):
    server = start_server(synth_model_factory(SPEC), "-np", "2", "-c", "512", "--temp", "0",
                          "--slot-save-path", str(tmp_path))
    with httpx.Client(base_url=server.base_url, timeout=120) as http:
        body = {"prompt": PROMPT, "n_predict": 4}
        first = http.post("/completion", json=body).json()
        n_kv = first["tokens_evaluated"] + 3          # the last token sampled is not decoded
        saved = http.post("/slots/0?action=save", json={"filename": "s.bin"}).json()
        assert saved["n_saved"] == n_kv and saved["n_written"] > 0
        assert (tmp_path / "s.bin").stat().st_size == saved["n_written"]
        assert http.post("/slots/0?action=erase").json() == {"id_slot": 0, "n_erased": n_kv}
        restored = http.post("/slots/1?action=restore", json={"filename": "s.bin"}).json()
        assert restored["n_restored"] == n_kv and restored["n_read"] == saved["n_written"]
        again = http.post("/completion", json=body).json()     # slot 1 holds the prefix now
        assert again["timings"]["cache_n"] == first["tokens_evaluated"] - 1
        assert again["content"] == first["content"]
        for bad, status in [("/slots/0?action=save", 400), ("/slots/x?action=erase", 400),
                            ("/slots/9?action=erase", 400), ("/slots/0?action=fly", 400)]:
            r = http.post(bad, json={"filename": "../escape"})
            assert r.status_code == status and r.json()["error"]["code"] == status, r.text
        r = http.post("/slots/0?action=restore", json={"filename": "missing.bin"})
        assert r.status_code == 400
    r = httpx.post(f"{server.base_url}/slots/0?action=erase")
    assert r.status_code == 200


def test_slot_actions_on_a_single_engine(start_server, synth_model_factory, tmp_path):
    server = start_server(synth_model_factory(SPEC), "-c", "256", "--temp", "0",
                          "--slot-save-path", str(tmp_path))
    with httpx.Client(base_url=server.base_url, timeout=120) as http:
        body = {"prompt": PROMPT, "n_predict": 3}
        first = http.post("/completion", json=body).json()
        saved = http.post("/slots/0?action=save", json={"filename": "one.bin"}).json()
        assert saved["n_saved"] == first["tokens_evaluated"] + 2
        assert http.post("/slots/0?action=erase").json()["n_erased"] == saved["n_saved"]
        assert http.post("/completion", json=body).json()["timings"]["cache_n"] == 0
        http.post("/completion", json={"prompt": "something else", "n_predict": 1})
        assert http.post("/slots/0?action=restore",
                         json={"filename": "one.bin"}).json()["n_restored"] == saved["n_saved"]
        again = http.post("/completion", json=body).json()
        assert again["timings"]["cache_n"] == first["tokens_evaluated"] - 1
        assert again["content"] == first["content"]
        assert http.post("/slots/1?action=erase").status_code == 400


@pytest.mark.parametrize("parallel", ["1", "2"])
def test_context_shift_generates_past_the_context(start_server, synth_model_factory, parallel):
    server = start_server(synth_model_factory(SPEC), "-c", str(256 * int(parallel)), "-np",
                          parallel, "--temp", "0", "--context-shift")
    with httpx.Client(base_url=server.base_url, timeout=300) as http:
        n_slot = http.get("/props").json()["default_generation_settings"]["n_ctx"]
        body = {"prompt": PROMPT, "n_predict": n_slot + 40, "ignore_eos": True}
        for n_keep in (0, -1):
            r = http.post("/completion", json=body | {"n_keep": n_keep})
            assert r.status_code == 200, r.text
            answer = r.json()
            assert answer["timings"]["predicted_n"] == n_slot + 40 and answer["truncated"]
            assert answer["generation_settings"]["n_keep"] == n_keep
        short = http.post("/completion", json={"prompt": PROMPT, "n_predict": 8}).json()
        assert short["truncated"] is False and short["timings"]["predicted_n"] == 8


def test_id_slot_picks_the_slot(http):
    body = {"prompt": PROMPT + " in slot one", "n_predict": 2, "id_slot": 1}
    http.post("/completion", json=body)
    # the same prompt asked of slot 0 cannot reuse slot 1's KV; asked of slot 1, it does
    other = http.post("/completion", json=body | {"id_slot": 0}).json()["timings"]
    same = http.post("/completion", json=body).json()["timings"]
    assert same["cache_n"] > other["cache_n"]
    r = http.post("/completion", json=body | {"id_slot": 2})
    assert r.status_code == 400 and "id_slot" in r.json()["error"]["message"]
    choices = http.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "x"}], "max_tokens": 2, "n": 2, "id_slot": 0})
    assert choices.status_code == 200 and len(choices.json()["choices"]) == 2   # one by one
