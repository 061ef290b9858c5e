"""Start the real ``moe-offload serve`` process on a free loopback port for the server tests.

``start_server(model, *extra_args)`` launches ``python -m runtime.cli serve -m MODEL --port 0``
(``model`` None: no ``-m``, for router mode),
reads the bound port from its "listening on" line, waits until ``/health`` answers 200, and
stops the process (SIGTERM, then SIGKILL) when the fixture that started it is torn down.
"""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

REPO_ROOT = Path(__file__).resolve().parents[3]
STARTUP_TIMEOUT_S = 120.0
_LISTENING = re.compile(r"listening on http://([^\s]+):(\d+)")


@dataclass
class ServerProcess:
    proc: subprocess.Popen
    port: int
    log_path: Path
    # (status, JSON body) of every /health answer seen while waiting for the model
    health_seen: list[tuple[int, dict]] = field(default_factory=list)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def api_url(self) -> str:
        return f"{self.base_url}/v1"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def assert_alive(self) -> None:
        assert self.proc.poll() is None, f"server exited ({self.proc.returncode}):\n{self.log()}"

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=15)
        return self.proc.returncode


def launch(model: Path | None, log_path: Path, *extra: str) -> subprocess.Popen:
    """Start ``moe-offload serve`` on port 0 (the OS picks a free one), output to ``log_path``;
    ``model`` None: no ``-m`` (router mode: ``extra`` names the models)."""
    model_args = ["-m", str(model)] if model is not None else []
    cmd = [sys.executable, "-m", "runtime.cli", "serve", *model_args, "--port", "0", *extra]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    with open(log_path, "wb") as log:
        return subprocess.Popen(cmd, cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, env=env)


def wait_until_ready(proc: subprocess.Popen, log_path: Path) -> ServerProcess:
    """Read the port from the log, then poll /health until it answers 200."""
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    port = None
    seen: list[tuple[int, dict]] = []
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"server exited ({proc.returncode}):\n"
                                 f"{log_path.read_text(errors='replace')}")
        if port is None:
            match = _LISTENING.search(log_path.read_text(errors="replace"))
            if match:
                port = int(match.group(2))
                assert match.group(1) == "127.0.0.1", "the server must bind loopback by default"
        if port is not None:
            try:
                r = httpx.get(f"http://127.0.0.1:{port}/health", timeout=2)
            except httpx.TransportError:
                pass
            else:
                seen.append((r.status_code, r.json()))
                if r.status_code == 200:
                    return ServerProcess(proc, port, log_path, seen)
        time.sleep(0.1)
    proc.kill()
    raise AssertionError(f"server not ready in {STARTUP_TIMEOUT_S}s:\n"
                         f"{log_path.read_text(errors='replace')}")


@pytest.fixture(scope="module")
def start_server(
        tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[..., ServerProcess]]:
    """Module-scoped launcher: every server it starts is stopped after the module's tests."""
    started: list[ServerProcess] = []

    def start(model: Path | None, *extra: str) -> ServerProcess:
        log_path = tmp_path_factory.mktemp("server") / "server.log"
        server = wait_until_ready(launch(model, log_path, *extra), log_path)
        started.append(server)
        return server

    yield start
    for server in started:
        server.stop()
    for server in started:    # no request may make the server print a traceback
        assert "Traceback" not in server.log(), server.log()
