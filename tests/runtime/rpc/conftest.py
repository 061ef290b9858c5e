"""Fixtures for the RPC tests: the patched build with ggml-rpc (this install's, the same one
tests/native uses), two real ``moe-offload rpc-server`` processes on free loopback ports, and a
child process that runs the Engine with that build."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from gguf_tools.synth import SynthSpec
from tests.conftest import free_port

REPO_ROOT = Path(__file__).resolve().parents[3]
CHILD = Path(__file__).with_name("rpc_child.py")
# 8 layers x 16 experts, f32: ~7 MB of experts and ~1 MB of dense weights per layer, so
# budgets of a few layers split it three ways
SPLIT_SPEC = SynthSpec(arch="qwen3moe", layers=8, experts=16, top_k=2, embd=256, ff=128,
                       dtype="f32", seed=3, skew=1.0)


@pytest.fixture(scope="session")
def rpc_build(llama_build):
    """This install's patched build (tests/conftest.py): every build has ggml's RPC backend
    (libggml-rpc) unless made with --no-rpc."""
    assert llama_build.rpc, f"{llama_build.lib_dir}: built without the RPC backend"
    return llama_build


def child_env(lib_dir: str) -> dict:
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT), PYTHONUNBUFFERED="1",
               LLAMA_CPP_LIB_PATH=lib_dir)
    return env


@dataclass
class RpcServer:
    proc: subprocess.Popen
    port: int
    log_path: Path

    @property
    def device(self) -> str:
        return f"rpc:127.0.0.1:{self.port}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)


def start_rpc_server(lib_dir: str, log_path: Path, *extra: str, port: int | None = None,
                     wait: bool = True) -> RpcServer:
    port = port or free_port()
    cmd = [sys.executable, "-m", "runtime.cli", "rpc-server", "--port", str(port),
           "--threads", "1", *extra]
    with open(log_path, "wb") as log:
        # SIGINT at its default in the child, as in a shell, whatever this process did with
        # it: an ignored SIGINT is inherited (pytest started as `cmd &` from a script), Python
        # then installs no handler, and the Ctrl-C test would wait for nothing
        proc = subprocess.Popen(cmd, cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, env=child_env(lib_dir),
                                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    server = RpcServer(proc, port, log_path)
    if wait:
        deadline = time.monotonic() + 60
        while "rpc-server: listening on" not in server.log():
            if proc.poll() is not None or time.monotonic() > deadline:
                server.stop()
                raise AssertionError(f"rpc-server did not start:\n{server.log()}")
            time.sleep(0.05)
    return server


@pytest.fixture
def rpc_servers(rpc_build, tmp_path):
    """Two fresh rpc-servers (killed after the test)."""
    servers = [start_rpc_server(rpc_build.lib_dir, tmp_path / f"rpc{i}.log") for i in range(2)]
    yield servers
    for s in servers:
        s.stop()


@pytest.fixture(scope="session")
def split_model(synth_model_factory) -> Path:
    return synth_model_factory(SPLIT_SPEC)


def run_child(lib_dir: str, args: dict, timeout: float = 300) -> dict:
    proc = subprocess.run([sys.executable, str(CHILD), json.dumps(args)], env=child_env(lib_dir),
                          capture_output=True, text=True, timeout=timeout, cwd=REPO_ROOT)
    if proc.returncode != 0:
        raise AssertionError(f"rpc child failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    out["stderr"] = proc.stderr
    return out


def write_config(path: Path, devices: dict[str, str], mode: str | None = None) -> Path:
    lines = ["[devices]"] + [f'"{k}" = "{v}"' for k, v in devices.items()]
    if mode:
        lines += ["[rpc]", f'mode = "{mode}"']
    path.write_text("\n".join(lines) + "\n")
    return path
