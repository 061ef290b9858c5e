"""The server's own writers, SIGKILLed at 10 random moments mid-write (tests/runtime/
test_atomic_write.py kills each writer in a forked child; here the real server is killed):

- ``POST /slots/0?action=save``: the slot file (runtime/engine/slot_file.py) goes to a temp file,
  renamed into place;
- ``serve --write-profile``: the profile written at shutdown (SIGTERM, then the kill).

The previous file stays byte-identical (or, once the rename happened, the whole new file is
there), and the next writer removes every temp file the killed servers left.
"""
from __future__ import annotations

import random
import re
import signal
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import pytest

from runtime.residency.profile import read_profile
from tests.runtime.server.conftest import launch, wait_until_ready
from tests.runtime.test_atomic_write import KILLS, temps

pytestmark = pytest.mark.slow
PROMPT = "the quick brown fox jumps over the lazy dog " * 40


def _start(model: Path, log_dir: Path, *extra: str):
    log = log_dir / f"server-{time.monotonic_ns()}.log"
    return wait_until_ready(launch(model, log, *extra), log)


def _until(predicate, timeout: float = 60.0) -> bool:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.0001)
    return True


def test_slot_save_through_the_server_killed(tmp_path, tiny_model):
    slots = tmp_path / "slots"
    slots.mkdir()
    target = slots / "slot0.bin"
    args = ("--slot-save-path", str(slots), "-c", "4096")

    def save(server) -> httpx.Response:
        return httpx.post(f"{server.base_url}/slots/0?action=save",
                          json={"filename": target.name}, timeout=60)

    server = _start(tiny_model, tmp_path, *args)
    r = httpx.post(f"{server.base_url}/completion", timeout=120, json={
        "prompt": PROMPT, "n_predict": 1, "temperature": 0, "id_slot": 0})
    assert r.status_code == 200, r.text
    assert save(server).status_code == 200
    old = target.read_bytes()
    window = max(save(server).json()["timings"]["save_ms"] / 1e3, 0.001)
    rng = random.Random(0)
    interrupted = 0
    for kill in range(KILLS):
        pid = server.proc.pid
        stop = threading.Event()

        def hammer(server=server, stop=stop) -> None:   # saves until the server is gone
            while not stop.is_set():
                try:
                    save(server)
                except httpx.TransportError:
                    return
        saver = threading.Thread(target=hammer)
        saver.start()
        assert _until(lambda: temps(target, pid)), "no save started"
        time.sleep(0.0 if kill == 0 else rng.uniform(0, window))
        server.proc.kill()
        server.proc.wait(timeout=30)
        stop.set()
        saver.join(timeout=60)
        interrupted += bool(temps(target, pid))
        # every save writes the same state: anything but these bytes is a partial file
        assert target.read_bytes() == old
        server = _start(tiny_model, tmp_path, *args)
        r = httpx.post(f"{server.base_url}/slots/0?action=restore",
                       json={"filename": target.name}, timeout=60)
        assert r.status_code == 200, r.text
    assert interrupted >= 1, "no kill landed mid-write"
    assert save(server).status_code == 200          # the next writer cleans up
    assert target.read_bytes() == old and temps(target) == []
    server.stop()


def _profile_temp(target: Path, pid: int) -> bool:
    """The profile's own temp file (not the scratch trace beside it) is there."""
    own = re.compile(rf"^\.{re.escape(target.name)}\.tmp-{pid}-[0-9a-f]+$")
    return any(own.match(n) for n in temps(target, pid))


def test_write_profile_at_shutdown_killed(tmp_path, tiny_model):
    target = tmp_path / "served.npz"
    args = ("--write-profile", str(target), "-c", "256")

    def serve(n_predict: int):
        server = _start(tiny_model, tmp_path / "logs", *args)
        r = httpx.post(f"{server.base_url}/completion", timeout=60, json={
            "prompt": "the king saw a river", "n_predict": n_predict, "temperature": 0})
        assert r.status_code == 200, r.text
        server.proc.send_signal(signal.SIGTERM)
        return server

    (tmp_path / "logs").mkdir()
    serve(4).proc.wait(timeout=60)                    # the previous profile: 4 tokens
    old = target.read_bytes()
    server = serve(12)                                # the new one, uninterrupted: 12
    assert _until(lambda: _profile_temp(target, server.proc.pid) or server.proc.poll()
                  is not None)
    t0 = time.monotonic()
    server.proc.wait(timeout=60)
    window = max(time.monotonic() - t0, 0.001)
    new = read_profile(target)
    target.write_bytes(old)
    rng = random.Random(1)
    interrupted = 0
    for kill in range(KILLS):
        server = serve(12)
        pid = server.proc.pid
        assert _until(lambda: _profile_temp(target, pid) or server.proc.poll() is not None)
        time.sleep(0.0 if kill == 0 else rng.uniform(0, window))
        server.proc.kill()
        server.proc.wait(timeout=30)
        interrupted += _profile_temp(target, pid)
        if target.read_bytes() != old:                # only once the rename happened
            assert np.array_equal(read_profile(target).count, new.count), "a partial file"
            target.write_bytes(old)
    assert interrupted >= 1, "no kill landed mid-write"
    serve(12).proc.wait(timeout=60)                   # the next writer cleans up
    assert np.array_equal(read_profile(target).count, new.count)
    assert temps(target) == []
