"""Router mode on the real server: several synthetic models behind one ``moe-offload serve``
(``--models-dir``, ``--models-preset``), talked to with the ``openai`` and ``anthropic``
clients and httpx: the listing with each model's status and budget, ``"model"`` picking the
model (an unknown one refused in each API's shape), load and unload with their
``/models/sse`` events, the least recently used idle model unloaded to make room (for
``--models-max`` or for the shared ``cpu`` budget, saying why), ``--no-models-autoload`` and
the API key. States are polled, never timed."""
from __future__ import annotations

import time
from pathlib import Path

import anthropic
import httpx
import openai
import pytest

from tests.runtime.server.error_shapes import error_of
from tests.runtime.server.models_api import (Events, chat, load, resident_expert_bytes,
                                             small_spec, statuses, unload_all, wait_status)

KIB = 1024
POOL = 900 * KIB                      # the server's cpu budget: 3 x 300 KiB by default
SHARE = POOL // 3                     # --models-max 3: a model that asks nothing gets this
ONE_USE_ROOM = 8 * 3 * 64 * 32 * 4     # every expert of one layer of small_spec (192 KiB)


@pytest.fixture(scope="module")
def models_dir(tmp_path_factory, synth_model_factory) -> Path:
    """alpha, beta, gamma: three small MoE models (their own files) in one directory."""
    root = tmp_path_factory.mktemp("models")
    for seed, name in enumerate(("alpha", "beta", "gamma"), start=11):
        (root / f"{name}.gguf").symlink_to(synth_model_factory(small_spec(seed)))
    return root


@pytest.fixture(scope="module")
def preset(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("preset") / "models.ini"
    path.write_text("[*]\nctx-size = 512\n\n[alpha]\nalias = a,first\ntags = small\n\n"
                    "[gamma]\ndevices.cpu = 50%\n")
    return path


@pytest.fixture(scope="module")
def server(start_server, models_dir, preset):
    return start_server(None, "--models-dir", str(models_dir), "--models-preset", str(preset),
                        "--models-max", "3", "--devices.cpu", f"{POOL // KIB}KiB")


@pytest.fixture()
def http(server):
    with httpx.Client(base_url=server.base_url, timeout=60) as client:
        unload_all(client)
        yield client


def test_listing_shows_every_model_its_status_aliases_and_source(server, http):
    client = openai.OpenAI(base_url=server.api_url, api_key="x", max_retries=0)
    assert sorted(m.id for m in client.models.list()) == ["alpha", "beta", "gamma"]
    models = statuses(http)
    assert {n: m["status"]["value"] for n, m in models.items()} == {
        "alpha": "unloaded", "beta": "unloaded", "gamma": "unloaded"}
    assert models["alpha"]["aliases"] == ["a", "first"] and models["alpha"]["tags"] == ["small"]
    assert models["alpha"]["source"] == "preset" and models["beta"]["source"] == "models_dir"
    assert "devices.cpu = 50%" in models["gamma"]["status"]["preset"]
    props = http.get("/props").json()
    assert props["role"] == "router" and props["max_instances"] == 3
    assert props["models_autoload"] is True and props["build_info"].startswith("b")


def test_the_model_field_picks_the_model_and_loads_it_on_demand(server, http):
    client = openai.OpenAI(base_url=server.api_url, api_key="x", max_retries=0, timeout=60)
    answer = client.chat.completions.create(model="beta", max_tokens=4, temperature=0,
                                            messages=[{"role": "user", "content": "hi"}])
    assert answer.model == "beta" and answer.choices[0].message.content
    assert statuses(http)["beta"]["status"]["value"] == "loaded"
    assert statuses(http)["alpha"]["status"]["value"] == "unloaded"   # nothing else loaded
    # an alias names its model; the answer says the model's own name
    r = chat(http, "first")
    assert r.status_code == 200 and r.json()["model"] == "alpha"
    # the request that waited for the load says how long (ours: timings.wake_ms)
    assert r.json()["timings"]["wake_ms"] > 0
    again = chat(http, "alpha").json()
    assert "wake_ms" not in again["timings"]
    # the same prompt to another model: another model's weights, another answer's tokens
    native = {"prompt": "the king saw a river", "n_predict": 8, "temperature": 0,
              "return_tokens": True}
    a = http.post("/completion", json=native | {"model": "alpha"}).json()
    b = http.post("/completion", json=native | {"model": "beta"}).json()
    assert a["model"] == "alpha" and b["model"] == "beta" and a["tokens"] != b["tokens"]
    # GET routes name their model in the query
    props = http.get("/props", params={"model": "beta"}).json()
    assert props["model_alias"] == "beta" and props["is_sleeping"] is False


def test_an_unknown_or_missing_model_is_refused_in_each_apis_shape(server, http):
    client = openai.OpenAI(base_url=server.api_url, api_key="x", max_retries=0)
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model="no-such-model", max_tokens=4,
                                       messages=[{"role": "user", "content": "hi"}])
    assert refused.value.code == "model_not_found"
    assert "no-such-model" in refused.value.message and "alpha" in refused.value.message
    with pytest.raises(openai.BadRequestError):          # streamed: refused before any chunk
        list(client.chat.completions.create(model="no-such-model", stream=True, max_tokens=4,
                                            messages=[{"role": "user", "content": "hi"}]))
    claude = anthropic.Anthropic(base_url=server.base_url, api_key="x", max_retries=0)
    with pytest.raises(anthropic.BadRequestError) as refused:
        claude.messages.create(model="no-such-model", max_tokens=4,
                               messages=[{"role": "user", "content": "hi"}])
    assert refused.value.body["type"] == "error"
    r = http.post("/completion", json={"model": "no-such-model", "prompt": "x"})
    assert "not found" in error_of(r, "/completion")["message"]
    r = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]})
    assert error_of(r, "/v1/chat/completions")["code"] == "model_missing"
    r = http.post("/models/load", json={"model": "no-such-model"})
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
    r = http.post("/tools", json={"tool": "read_file", "params": {}})   # no model: the router's
    assert r.status_code == 403 and r.json()["error"]["type"] == "feature_disabled"
    assert all(m["status"]["value"] == "unloaded" for m in statuses(http).values())


def test_load_and_unload_with_their_events(server, http):
    events = Events(server.base_url)
    try:
        args = load(http, "beta")["status"]["args"]         # the flags it runs with
        assert args[0] == "serve" and args[args.index("--model") + 1].endswith("beta.gguf")
        assert args[args.index("--ctx-size") + 1] == "512"     # from the preset's [*]
        r = http.post("/models/load", json={"model": "beta"})
        assert r.status_code == 400 and "already running" in r.json()["error"]["message"]
        assert chat(http, "beta").status_code == 200
        r = http.post("/models/unload", json={"model": "beta"})
        assert r.status_code == 200 and r.json() == {"success": True}
        wait_status(http, "beta", {"unloaded"})
        r = http.post("/models/unload", json={"model": "beta"})
        assert r.status_code == 400 and "not running" in r.json()["error"]["message"]
        assert events.wait_for("beta", "loading")["event"] == "model_status"
        assert events.wait_for("beta", "loaded")["event"] == "status_change"
        gone = events.wait_for("beta", "unloaded")
        assert gone["data"]["reason"] == "POST /models/unload" and gone["data"]["exit_code"] == 0
    finally:
        events.close()


def test_each_model_gets_its_own_share_of_one_cpu_budget(server, http, models_dir):
    for name in ("alpha", "beta"):
        assert load(http, name)["budgets"] == {"cpu": SHARE}
        snapshot = http.get("/v1/residency", params={"model": name}).json()
        # its manager keeps experts within the share less the RAM tier's one-use room
        assert snapshot["devices"]["cpu"]["capacity_bytes"] == SHARE - ONE_USE_ROOM
    metrics = http.get("/metrics").text
    assert f'moe_router_pool_bytes{{device="cpu"}} {POOL}' in metrics
    assert f'moe_router_reserved_bytes{{device="cpu",model="alpha"}} {SHARE}' in metrics
    # nothing reads a whole model at load: only what its budget holds is in RAM
    for name in ("alpha", "beta"):
        assert resident_expert_bytes(models_dir / f"{name}.gguf") <= SHARE


def test_a_load_that_does_not_fit_the_budget_unloads_the_lru_idle_model_and_says_why(
        server, http):
    events = Events(server.base_url)
    try:
        load(http, "alpha")
        load(http, "beta")
        assert chat(http, "alpha").status_code == 200     # beta is now the least recent
        # gamma asks 50 % of the pool: 300 KiB are free, so one other model must go
        r = chat(http, "gamma")
        assert r.status_code == 200 and r.json()["model"] == "gamma"
        models = statuses(http)
        assert {n: m["status"]["value"] for n, m in models.items()} == {
            "alpha": "loaded", "beta": "unloaded", "gamma": "loaded"}
        assert models["gamma"]["budgets"] == {"cpu": POOL // 2}
        assert sum(m["budgets"].get("cpu", 0) for m in models.values()) <= POOL
        reason = events.wait_for("beta", "unloaded")["data"]["reason"]
        assert "gamma needs" in reason and "cpu budget" in reason, reason
    finally:
        events.close()


@pytest.fixture(scope="module")
def manual(start_server, models_dir, tmp_path_factory):
    """A router that loads only on request, one model at a time, behind an API key; its
    directory also holds a file that is no model."""
    root = tmp_path_factory.mktemp("manual")
    for name in ("alpha", "beta"):
        (root / f"{name}.gguf").symlink_to((models_dir / f"{name}.gguf").resolve())
    (root / "broken.gguf").write_bytes(b"GGUF but not really" * 64)
    return start_server(None, "--models-dir", str(root), "--no-models-autoload",
                        "--models-max", "1", "--api-key", "router-key", "-c", "512")


def test_no_autoload_models_max_and_the_api_key(manual):
    key = {"Authorization": "Bearer router-key"}
    with httpx.Client(base_url=manual.base_url, timeout=60) as http:
        assert http.get("/models").status_code == 200          # open, as llama-server's
        r = chat(http, "alpha")
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
        assert http.post("/models/load", json={"model": "alpha"}).status_code == 401
        r = http.post("/v1/chat/completions", headers=key, json={
            "model": "alpha", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
        assert r.status_code == 400 and r.json()["error"]["code"] == "model_not_loaded"
        assert http.get("/props", headers=key).json()["models_autoload"] is False
        load(http, "alpha", key)
        r = http.post("/v1/chat/completions", headers=key, json={
            "model": "alpha", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
        assert r.status_code == 200
        # --models-max 1: loading beta unloads alpha, saying why
        load(http, "beta", key)
        assert statuses(http, key)["alpha"]["status"]["value"] == "unloaded"
        # a file that does not load: the load fails, /models says why, the others go on
        assert http.post("/models/load", headers=key, json={"model": "broken"}).json() == \
            {"success": True}
        deadline = time.monotonic() + 60
        while not (broken := statuses(http, key)["broken"])["status"].get("failed"):
            assert time.monotonic() < deadline, broken
            time.sleep(0.05)
        assert broken["status"]["value"] == "unloaded" and "broken.gguf" in \
            broken["status"]["error"]
        assert statuses(http, key)["beta"]["status"]["value"] == "loaded"
        r = http.post("/completion", headers=key, json={"model": "broken", "prompt": "x"})
        assert r.status_code == 400 and r.json()["error"]["message"].startswith(
            "model 'broken' is not loaded")
    assert "model alpha unloaded (least recently used idle model: --models-max 1 reached, " \
           "beta is loading)" in manual.log()


def test_resumable_streams_find_their_model(server, http):
    """X-Conversation-Id streams behind a router: resumed and stopped through the router,
    their model named by the id's ``::NAME`` suffix or found by the session it holds."""
    for conversation, model in (("conv-1::beta", "beta"), ("plain-conv", "alpha")):
        with http.stream("POST", "/v1/chat/completions", headers={
                "X-Conversation-Id": conversation}, json={
                "model": model, "stream": True, "max_tokens": 4,
                "messages": [{"role": "user", "content": "hi"}]}) as r:
            assert r.status_code == 200 and "data: " in r.read().decode()
        replay = http.get("/v1/stream", params={"conv_id": conversation, "from": "0"})
        assert replay.status_code == 200 and f'"model":"{model}"' in replay.text
    found = http.post("/v1/streams/lookup",
                      json={"conversation_ids": ["conv-1::beta", "plain-conv", "other"]})
    assert sorted(s["conversation_id"] for s in found.json()) == ["conv-1::beta", "plain-conv"]
    assert http.delete("/v1/stream", params={"conv_id": "conv-1::beta"}).status_code == 204
    assert http.get("/v1/stream", params={"conv_id": "conv-1::beta"}).status_code == 404
    assert http.delete("/v1/stream", params={"conv_id": "never-was"}).status_code == 204


def test_reload_reads_the_preset_again(server, http, preset, models_dir):
    """``GET /models?reload=1``: a model added to the preset is served, one whose options
    changed is unloaded first (saying why), and a preset that is not right is a 400 that
    changes nothing."""
    text = preset.read_text()
    events = Events(server.base_url)
    try:
        load(http, "beta")
        preset.write_text(text + f"\n[beta]\nctx-size = 256\n\n[delta]\nmodel = "
                                 f"{(models_dir / 'alpha.gguf').resolve()}\nalias = d\n")
        models = {m["id"]: m for m in http.get("/models", params={"reload": "1"}).json()["data"]}
        assert sorted(models) == ["alpha", "beta", "delta", "gamma"]
        assert models["beta"]["status"]["value"] == "unloaded"
        assert events.wait_for("beta", "unloaded")["data"]["reason"] == "its preset changed"
        r = chat(http, "d")
        assert r.status_code == 200 and r.json()["model"] == "delta"
        preset.write_text("[broken\n")
        r = http.get("/models", params={"reload": "1"})
        assert r.status_code == 400 and "not a valid INI file" in r.json()["error"]["message"]
        assert sorted(statuses(http)) == ["alpha", "beta", "delta", "gamma"]
    finally:
        events.close()
        preset.write_text(text)
        http.get("/models", params={"reload": "1"})
    assert sorted(statuses(http)) == ["alpha", "beta", "gamma"]
