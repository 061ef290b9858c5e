"""What llama.cpp's newest server tests expect, on the real server: a slot's context is the
requested ``-c`` over ``-np``; ``--context-shift`` cuts a prompt too long for the slot (and
without it the prompt is refused); ``/slots?fail_on_no_slot`` is a 503 while every slot is
busy; tool calls in the history with arguments that are not JSON are a 400 naming the message
and its role; the metric names of llama-server; its CORS preflight (the origin echoed, with
credentials); ``/cors-proxy``'s 400 for internal and unresolvable targets; ``/models`` with
llama-server's ``models`` list and capabilities; the UI's ``bundle.js`` / ``bundle.css``
served without the API key; ``/v1/responses`` with ``timings_per_token`` and
``return_progress``; an assistant prefill of several text parts run together; ``messages: []``
on ``/v1/messages`` answered; ``/rerank`` without ``--reranking``, ``/lora-adapters`` without
``--lora`` and ``/tools`` (built-in tools and MCP off) answered as llama-server answers them."""
from __future__ import annotations

import json
from pathlib import Path

import httpx
import openai
import pytest

KEY = "sk-parity-3c1"
AUTH = {"Authorization": f"Bearer {KEY}"}
LONG = " ".join(["the king saw a river near the old house and"] * 30)   # > 128 tokens


@pytest.fixture(scope="module")
def server(start_server, tiny_model: Path):
    return start_server(tiny_model, "-c", "256", "-np", "2", "--temp", "0", "--slots",
                        "--metrics", "--api-key", KEY)


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.base_url, timeout=120, headers=AUTH) as client:
        yield client


def test_a_slot_holds_the_requested_context_over_the_slots(http):
    assert http.get("/props").json()["default_generation_settings"]["n_ctx"] == 128
    assert [s["n_ctx"] for s in http.get("/slots").json()] == [128, 128]


def test_a_prompt_longer_than_the_slot_is_refused_without_context_shift(http):
    r = http.post("/completion", json={"prompt": LONG, "n_predict": 4})
    assert r.status_code == 400
    assert "exceeds the available context size" in r.json()["error"]["message"]


def test_context_shift_cuts_a_long_prompt_as_llama_server(start_server, tiny_model: Path):
    server = start_server(tiny_model, "-c", "256", "-np", "2", "--temp", "0",
                          "--context-shift")
    with httpx.Client(base_url=server.base_url, timeout=120) as http:
        n_prompt = len(http.post("/tokenize", json={"content": LONG,
                                                    "add_special": True}).json()["tokens"])
        assert n_prompt > 128
        r = http.post("/completion", json={"prompt": LONG, "n_predict": 16,
                                           "ignore_eos": True})
        assert r.status_code == 200, r.text
        body = r.json()
        # llama-server keeps n_keep (0) tokens, then drops whole blocks of (128 - 0) / 2 tokens
        erased = (n_prompt - 64) // 64
        assert body["truncated"] is True
        assert body["timings"]["prompt_n"] == n_prompt - erased * 64
        assert body["timings"]["predicted_n"] == 16


def test_fail_on_no_slot_is_a_503_while_every_slot_is_busy(start_server, tiny_model: Path):
    server = start_server(tiny_model, "-c", "256", "--temp", "0", "--slots",
                          "--context-shift")
    with httpx.Client(base_url=server.base_url, timeout=120) as http:
        idle = http.get("/slots", params={"fail_on_no_slot": "1"})
        assert idle.status_code == 200 and len(idle.json()) == 1
        body = {"prompt": "once", "n_predict": 1_000_000, "ignore_eos": True, "stream": True}
        with http.stream("POST", "/completion", json=body) as stream:
            events = (line for line in stream.iter_lines() if line.startswith("data: "))
            for _ in zip(range(1000), events):  # until /slots sees the one slot generating
                if http.get("/slots").json()[0]["is_processing"]:
                    break
            busy = http.get("/slots", params={"fail_on_no_slot": "1"})
            assert busy.status_code == 503
            assert busy.json()["error"]["type"] == "unavailable_error"
            assert http.get("/slots").status_code == 200    # without the parameter: the list


def test_malformed_tool_call_arguments_in_the_history_are_a_400(server):
    client = openai.OpenAI(base_url=server.api_url, api_key=KEY)
    history = [{"role": "user", "content": "weather?"},
               {"role": "assistant", "content": None, "tool_calls": [{
                   "id": "call_1", "type": "function",
                   "function": {"name": "get_weather", "arguments": "{\"city\": \"Par"}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    with pytest.raises(openai.BadRequestError, match="not JSON") as err:
        client.chat.completions.create(model="m", messages=history, max_tokens=2)
    error = err.value.body                          # names the message and its role
    assert error["param"] == "messages.1" and "assistant message" in error["message"]
    assert "tool_calls.0.function.arguments" in error["message"]
    r = httpx.post(f"{server.base_url}/v1/responses", headers=AUTH, json={"input": [
        {"role": "user", "content": "weather?"},
        {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": "{"}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "input.1.arguments"
    assert "function_call" in r.json()["error"]["message"]
    history[1]["tool_calls"][0]["function"]["arguments"] = json.dumps({"city": "Paris"})
    r = httpx.post(f"{server.base_url}/apply-template", headers=AUTH,
                   json={"messages": history})
    assert r.status_code == 200 and "Paris" in r.json()["prompt"]


def test_post_sampling_probs_greedy_gives_n_entries(http):
    r = http.post("/completion", json={"prompt": "the king saw", "n_predict": 3,
                                       "n_probs": 5, "post_sampling_probs": True})
    for entry in r.json()["completion_probabilities"]:
        probs = [p["prob"] for p in entry["top_probs"]]
        assert len(probs) == 5 and probs == sorted(probs, reverse=True)
        assert sum(probs) == pytest.approx(1.0) and entry["prob"] == probs[0]


def test_metric_names_of_llama_server(http):
    body = {"prompt": "the king saw a river", "n_predict": 2, "cache_prompt": True}
    http.post("/completion", json=body)
    assert http.post("/completion", json=body).json()["timings"]["cache_n"] > 0
    text = http.get("/metrics").text
    values = {line.split()[0]: float(line.split()[1]) for line in text.splitlines()
              if line.startswith("llamacpp:")}
    assert values["llamacpp:prompt_tokens_cache_total"] >= 1
    assert values["llamacpp:prompt_tokens_cache_total"] == values[
        "llamacpp:prompt_tokens_cached_total"]
    assert 0 < values["llamacpp:prompt_cache_hit_ratio"] < 1


def test_the_rate_gauges_cover_the_window_since_the_last_scrape(http):
    """llama-server's prompt/predicted_tokens_seconds are averaged over the time between two
    scrapes (its buckets): a scrape after a generation reports its rate, the next one, with
    nothing generated between, 0; the totals stay."""
    def scrape() -> dict[str, float]:
        return {line.split()[0]: float(line.split()[1])
                for line in http.get("/metrics").text.splitlines()
                if line.startswith("llamacpp:")}
    http.post("/completion", json={"prompt": "a window of time", "n_predict": 6,
                                   "cache_prompt": False})
    first, second = scrape(), scrape()
    assert first["llamacpp:predicted_tokens_seconds"] > 0
    assert first["llamacpp:prompt_tokens_seconds"] > 0
    assert second["llamacpp:predicted_tokens_seconds"] == 0
    assert second["llamacpp:prompt_tokens_seconds"] == 0
    assert second["llamacpp:tokens_predicted_total"] == first["llamacpp:tokens_predicted_total"]


@pytest.mark.parametrize("origin", ["web.mydomain.fr", "localhost", "http://localhost:5173"])
def test_cors_preflight_echoes_the_origin_with_credentials(server, origin):
    r = httpx.options(f"{server.base_url}/completions", headers={
        "Origin": origin, "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "Authorization"})
    assert r.status_code == 200
    assert r.headers["Access-Control-Allow-Origin"] == origin
    assert r.headers["Access-Control-Allow-Credentials"] == "true"
    assert r.headers["Access-Control-Allow-Methods"] == "GET, POST"
    assert r.headers["Access-Control-Allow-Headers"] == "*"


# internal targets, a metadata name and names that cannot resolve (none needs a DNS query:
# literals, names refused by name, a label over 63 characters)
REFUSED_TARGETS = ["http://127.0.0.1:1/", "http://10.0.0.1:1/", "http://169.254.169.254/",
                   "http://[::1]:1/", "http://[::ffff:127.0.0.1]:1/",
                   "http://metadata.google.internal/", "http://metadata.goog./",
                   f"http://{'a' * 64}.example/"]


def test_cors_proxy_refuses_internal_and_unresolvable_targets_with_400(start_server,
                                                                       tiny_model: Path):
    server = start_server(tiny_model, "--ui-mcp-proxy", "--ui-mcp-proxy-allow", "192.0.2.1")
    for url in REFUSED_TARGETS:
        r = httpx.get(f"{server.base_url}/cors-proxy", params={"url": url}, timeout=30)
        assert r.status_code == 400, (url, r.text)
        assert r.json()["error"]["type"] == "invalid_request_error", r.text


def _sse(http: httpx.Client, path: str, body: dict) -> list[dict]:
    with http.stream("POST", path, json=body | {"stream": True}) as r:
        assert r.status_code == 200, r.read()
        return [json.loads(line[6:]) for line in r.iter_lines()
                if line.startswith("data: ") and line != "data: [DONE]"]


def test_responses_take_timings_per_token_and_return_progress(http):
    events = _sse(http, "/v1/responses", {"input": "This is a test " * 10,
                                          "max_output_tokens": 8, "timings_per_token": True,
                                          "return_progress": True})
    progress = [e for e in events if "prompt_progress" in e]
    assert progress and all(e["type"] == "response.in_progress" for e in progress)
    last = progress[-1]["prompt_progress"]
    assert last["total"] > 0 and last["processed"] == last["total"] >= last["cache"]
    deltas = [e for e in events if e["type"] == "response.output_text.delta"]
    assert deltas and any("timings" in e for e in deltas)
    assert all({"prompt_per_second", "predicted_per_second"} <= set(e["timings"])
               for e in events if "timings" in e)
    completed = events[-1]
    assert completed["type"] == "response.completed" and "usage" in completed["response"]
    assert completed["timings"]["predicted_n"] == completed["response"]["usage"][
        "output_tokens"]
    plain = _sse(http, "/v1/responses", {"input": "hi", "max_output_tokens": 2})
    assert not any("prompt_progress" in e for e in plain)
    assert not any("timings" in e for e in plain if e["type"] != "response.completed")
    whole = http.post("/v1/responses", json={"input": "hi", "max_output_tokens": 2,
                                             "timings_per_token": True}).json()
    assert whole["timings"]["predicted_n"] == whole["usage"]["output_tokens"]


def test_an_assistant_prefill_of_parts_is_run_together(http):
    def prompt(content) -> str:
        r = http.post("/apply-template", json={"messages": [
            {"role": "user", "content": "Tell me a story"},
            {"role": "assistant", "content": content}]})
        assert r.status_code == 200, r.text
        return r.json()["prompt"]
    parts = [{"type": "text", "text": "Once upon"}, {"type": "text", "text": " a time"}]
    assert prompt(parts) == prompt("Once upon a time")      # llama-server appends each part
    assert prompt(parts).endswith("Once upon a time")       # left open: the answer goes on
    usage = {}
    for content in (parts, "Once upon a time"):
        r = http.post("/v1/chat/completions", json={"max_tokens": 1, "messages": [
            {"role": "user", "content": "Tell me a story"},
            {"role": "assistant", "content": content}]})
        usage[str(content)] = r.json()["usage"]["prompt_tokens"]
    assert len(set(usage.values())) == 1
    anthropic = http.post("/v1/messages/count_tokens", json={"messages": [
        {"role": "user", "content": "Tell me a story"},
        {"role": "assistant", "content": [{"type": "text", "text": "Once upon"},
                                          {"type": "text", "text": " a time"}]}]})
    assert anthropic.json()["input_tokens"] == usage["Once upon a time"]


def test_empty_messages_on_the_messages_api_are_answered(http):
    r = http.post("/v1/messages", json={"max_tokens": 4, "messages": []})
    assert r.status_code == 200, r.text
    assert r.json()["type"] == "message" and r.json()["role"] == "assistant"
    assert http.post("/v1/messages/count_tokens",
                     json={"messages": []}).json()["input_tokens"] >= 0
    r = http.post("/v1/chat/completions", json={"max_tokens": 4, "messages": []})
    assert r.status_code == 400 and "at least one message" in r.json()["error"]["message"]


def test_models_lists_capabilities(server):
    body = httpx.get(f"{server.base_url}/models").json()        # public, as llama-server's
    assert body["models"][0]["capabilities"] == ["completion"]
    assert body["data"][0]["capabilities"] == ["completion"]
    assert body["models"][0]["name"] == body["data"][0]["id"]
    client = openai.OpenAI(base_url=server.api_url, api_key=KEY)
    assert [m.id for m in client.models.list()] == [body["data"][0]["id"]]


def test_ui_bundle_assets_need_no_key(server):
    for path, kind in (("/bundle.js", "javascript"), ("/bundle.css", "css")):
        r = httpx.get(f"{server.base_url}{path}")
        assert r.status_code == 200 and kind in r.headers["content-type"]
    assert httpx.post(f"{server.base_url}/completions", json={"prompt": "x"}).status_code == 401


def test_vertex_ai_predict_route(start_server, tiny_model: Path, monkeypatch):
    monkeypatch.setenv("AIP_MODE", "PREDICTION")        # Vertex AI's container variables
    monkeypatch.setenv("AIP_HEALTH_ROUTE", "/vertex-health")
    server = start_server(tiny_model, "-np", "2", "--temp", "0", "--api-key", KEY)
    chat = {"max_tokens": 4, "messages": [{"role": "user", "content": "hi"}], "stream": True}
    with httpx.Client(base_url=server.base_url, timeout=120, headers=AUTH) as http:
        r = http.post("/predict", json={"instances": [
            {"@requestFormat": "chatCompletions", **chat},
            {"@requestFormat": "/v1/chat/completions", **chat},
            {"@requestFormat": "tokenize", "content": "hi"},
            {"@requestFormat": "noSuchRoute"}, "not an object"]})
        assert r.status_code == 200, r.text
        first, second, tokens, unknown, bad = r.json()["predictions"]
        assert first["choices"][0]["message"]["role"] == "assistant"     # not streamed
        assert second["object"] == "chat.completion" and tokens["tokens"]
        assert "@requestFormat: noSuchRoute" in unknown["error"]["message"]
        assert bad["error"]["type"] == "invalid_request_error"
        assert http.post("/predict", json={"instances": 3}).status_code == 400
        assert http.get("/vertex-health").json() == {"status": "ok"}
        assert httpx.post(f"{server.base_url}/predict", json={"instances": []}).status_code == 401


def test_rerank_without_reranking_is_llama_servers_501(http):
    for path in ("/rerank", "/reranking", "/v1/rerank", "/v1/reranking"):
        r = http.post(path, json={"query": "x", "documents": ["a", "b"]})
        assert r.status_code == 501
        assert r.json()["error"]["message"] == ("This server does not support reranking. "
                                                "Start it with `--reranking`")
        assert r.json()["error"]["type"] == "not_supported_error"


def test_lora_adapters_without_lora(http):
    assert http.get("/lora-adapters").json() == []
    assert http.post("/lora-adapters", json=[]).json() == {"success": True}
    r = http.post("/lora-adapters", json={"id": 0, "scale": 1.0})
    assert r.status_code == 400
    assert r.json()["error"]["message"] == "Request body must be an array"


def test_tools_off_is_llama_servers_403(http):
    for method in ("GET", "POST"):
        r = http.request(method, "/tools", json={"tool": "read_file", "params": {}})
        assert r.status_code == 403
        assert r.json() == {"error": {"message": "this feature is disabled",
                                      "type": "feature_disabled"}}
