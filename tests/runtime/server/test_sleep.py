"""``--sleep-idle-seconds`` on the real server, with one model and behind a router: an idle
model falls asleep (its RAM tier's expert pages leave the page cache: mincore says so), the
read-only routes answer without waking it (``/health``, ``/props`` with ``is_sleeping``,
``/models``, ``/metrics`` from the text it had as it fell asleep, the chat page's expert map),
and the next generation wakes it, its timings saying how long that took (``wake_ms``).
States are polled, never timed."""
from __future__ import annotations

import time
from pathlib import Path

import httpx
import pytest

from tests.runtime.server.models_api import (chat, resident_expert_bytes, small_spec, statuses,
                                             wait_status)

WAIT_S = 120.0


def _until(check, what: str):
    deadline = time.monotonic() + WAIT_S
    while not (result := check()):
        assert time.monotonic() < deadline, f"never: {what}"
        time.sleep(0.05)
    return result


@pytest.fixture(scope="module")
def single(start_server, tiny_model):
    return start_server(tiny_model, "--sleep-idle-seconds", "1", "--alias", "tiny",
                        "--devices.cpu", "150KiB", "-c", "512")


def test_one_model_sleeps_when_idle_and_the_next_generation_wakes_it(single, tiny_model):
    with httpx.Client(base_url=single.base_url, timeout=60) as http:
        # (on a loaded machine the model may be asleep already: this request then wakes it)
        r = http.post("/completion", json={"prompt": "the king saw", "n_predict": 4})
        assert r.status_code == 200
        held = resident_expert_bytes(tiny_model)
        if not http.get("/props").json()["is_sleeping"]:     # still awake as we looked
            assert held > 0                                  # the tier holds experts
        # idle: it falls asleep; reading its state does not wake it
        props = _until(lambda: (p := http.get("/props").json())["is_sleeping"] and p,
                       "the model fell asleep")
        assert props["model_alias"] == "tiny" and props["total_slots"] == 1
        assert http.get("/health").json() == {"status": "ok"}
        assert [m["id"] for m in http.get("/v1/models").json()["data"]] == ["tiny"]
        metrics = http.get("/metrics").text                    # the text it fell asleep with
        assert "llamacpp:tokens_predicted_total 4" in metrics
        again = http.get("/metrics").text.splitlines()
        rates = ("llamacpp:predicted_tokens_seconds ", "llamacpp:prompt_tokens_seconds ")
        for line in metrics.splitlines():     # the same, but for the rates: a new window
            if line.startswith(rates):       # (since the last scrape: nothing ran)
                assert float(line.split()[1]) > 0 and line.split()[0] + " 0.0" in again
            else:
                assert line in again
        r = http.get("/v1/residency")
        assert r.status_code == 503 and r.json()["error"]["code"] == "model_sleeping"
        assert http.get("/props").json()["is_sleeping"] is True
        # asleep, its experts are out of RAM: the page cache holds none of them
        assert resident_expert_bytes(tiny_model) == 0
        # a generation wakes it, and says what the wake cost
        r = http.post("/completion", json={"prompt": "the king saw", "n_predict": 4})
        assert r.status_code == 200 and r.json()["timings"]["wake_ms"] > 0
        assert http.get("/props").json()["is_sleeping"] is False
        assert http.get("/v1/residency").status_code == 200
    assert "model tiny is asleep" in single.log() and "model tiny woke in" in single.log()


@pytest.fixture(scope="module")
def router(start_server, models_dir):
    return start_server(None, "--models-dir", str(models_dir), "--sleep-idle-seconds", "1",
                        "--devices.cpu", "600KiB", "-c", "512")


@pytest.fixture(scope="module")
def models_dir(tmp_path_factory, synth_model_factory) -> Path:
    root = tmp_path_factory.mktemp("sleepy")
    for seed, name in enumerate(("alpha", "beta"), start=21):
        (root / f"{name}.gguf").symlink_to(synth_model_factory(small_spec(seed)))
    return root


def test_behind_a_router_each_model_sleeps_and_wakes_keeping_its_budget(router, models_dir):
    with httpx.Client(base_url=router.base_url, timeout=60) as http:
        assert chat(http, "alpha").status_code == 200
        held = resident_expert_bytes(models_dir / "alpha.gguf")
        if statuses(http)["alpha"]["status"]["value"] == "loaded":     # still awake
            assert held > 0
        budgets = statuses(http)["alpha"]["budgets"]
        asleep = wait_status(http, "alpha", {"sleeping"})
        assert asleep["budgets"] == budgets                 # sleeping keeps its reservation
        assert resident_expert_bytes(models_dir / "alpha.gguf") == 0
        assert http.get("/props", params={"model": "alpha"}).json()["is_sleeping"] is True
        # the chat page's map of a sleeping model does not wake it
        r = http.get("/v1/residency", params={"model": "alpha", "autoload": "false"})
        assert r.status_code == 503 and r.json()["error"]["code"] == "model_sleeping"
        assert statuses(http)["alpha"]["status"]["value"] == "sleeping"
        r = chat(http, "alpha")
        assert r.status_code == 200 and r.json()["timings"]["wake_ms"] > 0
        assert statuses(http)["alpha"]["status"]["value"] == "loaded"
        assert statuses(http)["beta"]["status"]["value"] == "unloaded"
