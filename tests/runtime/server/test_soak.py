"""The soak (scripts/soak.py) for a minute: ``serve -np 4`` under mixed OpenAI / llama-server
/ streamed / structured / tool traffic with clients that hang up, invalid requests and broken
slot files. No 5xx, no malformed answer (NaN in JSON included), every invalid request a 4xx in
its route's shape, every broken slot refused and then serving, /metrics' request totals
equal to what the clients sent, the server alive and its log free of tracebacks."""
from __future__ import annotations

import importlib.util
import subprocess
import sys
import time

import pytest

from tests.runtime.server.conftest import REPO_ROOT


def _soak_module():
    spec = importlib.util.spec_from_file_location("soak", REPO_ROOT / "scripts" / "soak.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["soak"] = module                  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_a_minute_of_mixed_hostile_traffic(tiny_model):
    # (a minute ends inside the warm-up's climb: the RSS check is the 30-minute run's)
    report = _soak_module().soak(str(tiny_model), minutes=0.95, clients=6, seed=23,
                                 check_rss=False)
    outcomes = report["outcomes"]
    assert report["ok"], report
    for kind in ("ok_chat", "ok_text", "ok_native", "ok_structured", "ok_tool",
                 "invalid_refused", "slot_attack_refused"):
        assert outcomes.get(kind, 0) > 0, outcomes
    assert outcomes.get("dropped_waiting", 0) + outcomes.get("dropped_streaming", 0) > 0
    assert 0 < report["metrics"]["cancelled_total"]
    assert report["metrics"]["mismatched"] == {}
    assert report["rss_mib"]["growth"] < 0.25, report["rss_mib"]     # one minute: loose


def _memory_module():
    spec = importlib.util.spec_from_file_location("soak_memory",
                                                  REPO_ROOT / "scripts" / "soak_memory.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# a process that holds its memory still for a while, then (with an argument) takes 64 MiB
# more and touches it, then waits to be killed
_GROWER = ("import sys, time\ntime.sleep(0.6)\n"
           "held = bytearray(64 << 20) if len(sys.argv) > 1 else None\n"
           "if held is not None:\n    held[::4096] = b'x' * len(held[::4096])\n"
           "print('ready', flush=True)\ntime.sleep(60)\n")


@pytest.mark.parametrize("grows", [False, True])
def test_the_rss_check_fails_a_process_that_grows_after_its_warm_up(grows):
    """soak.py's RSS verdict (scripts/soak_memory.py): a process that takes 64 MiB after the
    warm-up fails the ±5% check and shows a rising slope; one that holds still passes."""
    memory = _memory_module()
    child = subprocess.Popen([sys.executable, "-c", _GROWER, *(["grow"] if grows else [])],
                             stdout=subprocess.PIPE, text=True)
    try:
        watch = memory.RssWatch(child.pid, every_s=0.05).start()
        assert child.stdout.readline() == "ready\n"
        time.sleep(0.5)                       # samples at the level it holds now
        report = watch.stop(warmup_s=0.3)
    finally:
        child.kill()
        child.wait()
    assert report["ok"] is not grows, report
    assert (report["growth"] > 0.5) is grows, report
    if grows:
        assert report["slope_mib_per_min"] > 0, report
    assert report["end"] <= report["peak"] and report["by_minute"]
