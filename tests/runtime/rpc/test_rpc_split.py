"""A synthetic model split across local memory and two real ``moe-offload rpc-server``
processes on 127.0.0.1, by budget: greedy tokens equal the all-local run, the placement
respects every budget, and a remote that dies mid-generation fails the request with a clear
error within 30 s while the server stays up."""
from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.runtime.rpc.conftest import (REPO_ROOT, child_env, free_port, run_child,
                                        start_rpc_server, write_config)

MiB = 2**20
# "load_tensors: RPC0[127.0.0.1:50901] model buffer size =    20.30 MiB" (per-server numbering)
_BUFFER = re.compile(r"RPC\d+\[([^\]]+)\]\s+(model|KV|compute) buffer size =\s+([\d.]+) MiB")


def _layer_bytes(model: Path) -> int:
    """Bytes of one whole layer of the split model (weights; every layer is alike)."""
    from gguf_tools.facts import open_gguf

    reader = open_gguf(model)
    return sum(int(t.n_bytes) for t in reader.tensors if t.name.startswith("blk.0."))


def _remote_buffers(buffers: list[str]) -> dict[str, float]:
    """rpc:host:port -> MiB llama.cpp allocated there (model + KV + compute)."""
    out: dict[str, float] = {}
    for line in buffers:
        m = _BUFFER.search(line)
        if m:
            device = f"rpc:{m.group(1)}"
            out[device] = out.get(device, 0.0) + float(m.group(3))
    return out


@pytest.fixture(scope="module")
def local_tokens(rpc_build, split_model):
    return run_child(rpc_build.lib_dir, {"model": str(split_model)})["tokens"]


@pytest.mark.parametrize("mode, mib_a, mib_b", [("layers", 40, 30), ("experts", 20, 16)])
def test_split_by_budget_is_token_identical_and_within_budget(
        rpc_build, rpc_servers, split_model, local_tokens, tmp_path, mode, mib_a, mib_b):
    a, b = rpc_servers
    layer = _layer_bytes(split_model)
    budgets = {a.device: mib_a * MiB, b.device: mib_b * MiB}    # a few layers each
    cfg = write_config(tmp_path / "split.toml",
                       {d: f"{v // MiB}MiB" for d, v in budgets.items()}, mode=mode)
    out = run_child(rpc_build.lib_dir, {"model": str(split_model), "config": str(cfg)})
    plan = out["remote"]
    assert plan["mode"] == mode
    shares = {s["device"]: s for s in plan["shares"]}
    assert all(shares[d]["layers"] for d in budgets), plan     # both remotes hold layers
    assert plan["local_layers"], plan                          # and so does local memory
    for d, budget in budgets.items():
        assert shares[d]["bytes"] <= budget
    # what llama.cpp really allocated on each remote (model + KV + compute) is within budget
    allocated = _remote_buffers(out["buffers"])
    assert set(allocated) == set(budgets), out["buffers"]
    for device, mib in allocated.items():
        assert mib * MiB <= budgets[device], (device, mib, out["buffers"])
    if mode == "layers":
        n_remote = sum(len(s["layers"]) for s in plan["shares"])
        model_mib = sum(float(m.group(3)) for line in out["buffers"]
                        if (m := _BUFFER.search(line)) and m.group(2) == "model")
        assert model_mib * MiB >= n_remote * layer * 0.99        # whole layers went remote
    assert out["tokens"] == local_tokens, "greedy tokens differ from the all-local run"
    assert "remote plan [" + mode in out["stderr"]             # shown at load


def test_device_cache_on_a_remote_is_token_identical_and_within_budget(
        rpc_build, rpc_servers, split_model, local_tokens, tmp_path):
    """[rpc] mode = "cache": every weight local, the device cache's slots on the
    remote, filled by the manager: the remote computes the hot experts."""
    a, _ = rpc_servers
    budget = 30 * MiB                            # about half the experts, plus compute
    cfg = write_config(tmp_path / "cache.toml", {a.device: "30MiB"}, mode="cache")
    out = run_child(rpc_build.lib_dir, {"model": str(split_model), "config": str(cfg)})
    assert out["tokens"] == local_tokens, "greedy tokens differ from the all-local run"
    assert out["remote"]["mode"] == "cache"
    assert "remote plan [cache]" in out["stderr"]
    dev = out["residency"]["devices"][a.device]
    slots = out["remote"]["shares"][0]["bytes"]
    assert 0 < dev["capacity_bytes"] <= slots < budget
    decode = dev["phases"]["decode"]
    assert decode["hits"] > 0 and decode["admissions"] > 0      # the remote slots served
    # llama.cpp's buffers there (compute only: no layer went remote) plus the slots fit
    allocated = _remote_buffers(out["buffers"])
    assert set(allocated) <= {a.device}
    assert allocated.get(a.device, 0.0) * MiB + slots <= budget, out["buffers"]
    model_lines = [b for b in out["buffers"] if "model buffer" in b and "RPC" in b]
    assert not model_lines, model_lines                          # no weight loaded there


def test_cache_mode_takes_one_remote_and_no_other_cache_device(tmp_path):
    from runtime.errors import UserError
    from runtime.residency.config import load_config

    for devices in ({"rpc:127.0.0.1:50052": "1GiB", "rpc:127.0.0.1:50053": "1GiB"},
                    {"rpc:127.0.0.1:50052": "1GiB", "cuda:0": "1GiB"}):
        cfg = write_config(tmp_path / "bad.toml", devices, mode="cache")
        with pytest.raises(UserError, match="one device per model"):
            load_config(cfg)


def test_unreachable_remote_at_load_is_one_line(rpc_build, split_model, tmp_path):
    port = free_port()
    cfg = write_config(tmp_path / "gone.toml", {f"rpc:127.0.0.1:{port}": "64MiB"})
    r = subprocess.run([sys.executable, "-m", "runtime.cli", "complete", "-m", str(split_model),
                        "--config", str(cfg), "-p", "hi", "-n", "4"], cwd=REPO_ROOT,
                       capture_output=True, text=True, timeout=120,
                       env=child_env(rpc_build.lib_dir))
    assert r.returncode != 0 and "Traceback" not in r.stderr
    errors = [ln for ln in r.stderr.splitlines() if ln.startswith("moe-offload: error")]
    assert len(errors) == 1 and f"rpc:127.0.0.1:{port}: unreachable" in errors[0], r.stderr


def test_plan_includes_reachable_remotes_and_its_toml_runs(
        rpc_build, rpc_servers, split_model, local_tokens, tmp_path):
    a, _b = rpc_servers
    gone = free_port()
    out = tmp_path / "plan.toml"
    r = subprocess.run([sys.executable, "-m", "runtime.cli", "plan", "-m", str(split_model),
                        "-c", "512", "--rpc", a.device, "--rpc", f"127.0.0.1:{gone}", "-o",
                        str(out)], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120,
                       env=child_env(rpc_build.lib_dir))
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    assert f"rpc:127.0.0.1:{gone}: unreachable" in r.stderr           # left out, said once
    from runtime.residency.config import load_config

    cfg = load_config(out)
    assert [b.device for b in cfg.remotes] == [a.device] and cfg.rpc_mode == "auto"
    assert cfg.remotes[0].bytes > 0
    text = out.read_text()
    assert "remote plan [" in text and f"127.0.0.1:{gone}" in text      # explained in comments
    check = subprocess.run([sys.executable, "-m", "runtime.cli", "config", "check", str(out),
                            "-m", str(split_model)], cwd=REPO_ROOT, capture_output=True,
                           text=True, timeout=60, env=child_env(rpc_build.lib_dir))
    assert check.returncode == 0, check.stderr
    run = run_child(rpc_build.lib_dir, {"model": str(split_model), "config": str(out)})
    assert run["remote"]["shares"][0]["layers"]                       # the remote is used
    assert run["tokens"] == local_tokens


def test_config_check_reports_capacity_and_refuses_too_big_a_budget(
        rpc_build, rpc_servers, split_model, tmp_path):
    a, _b = rpc_servers
    ok = write_config(tmp_path / "ok.toml", {a.device: "80%"})
    r = subprocess.run([sys.executable, "-m", "runtime.cli", "config", "check", str(ok), "-m",
                        str(split_model)], cwd=REPO_ROOT, capture_output=True, text=True,
                       timeout=60, env=child_env(rpc_build.lib_dir))
    assert r.returncode == 0, r.stderr
    line = next(ln for ln in r.stdout.splitlines() if a.device in ln)
    assert "reachable" in line and "free" in line and "rtt" in line
    assert "remote plan [" in r.stdout                     # what a load would place where
    big = write_config(tmp_path / "big.toml", {a.device: "64TiB"})
    r = subprocess.run([sys.executable, "-m", "runtime.cli", "config", "check", str(big)],
                       cwd=REPO_ROOT, capture_output=True, text=True, timeout=60,
                       env=child_env(rpc_build.lib_dir))
    assert r.returncode != 0 and "Traceback" not in r.stderr
    assert "above the device's total memory" in r.stderr and r.stderr.strip().count("\n") == 0
    third = write_config(tmp_path / "third.toml", {f"{a.device}/3": "1GiB"})
    r = subprocess.run([sys.executable, "-m", "runtime.cli", "config", "check", str(third)],
                       cwd=REPO_ROOT, capture_output=True, text=True, timeout=60,
                       env=child_env(rpc_build.lib_dir))
    assert r.returncode != 0 and "Traceback" not in r.stderr
    assert f"{a.device}/3: the server offers 1 device(s) (0..0), not device 3" in r.stderr


def test_rpc_server_help_bad_port_and_ctrl_c(rpc_build, tmp_path):
    env = child_env(rpc_build.lib_dir)
    h = subprocess.run([sys.executable, "-m", "runtime.cli", "rpc-server", "--help"],
                       cwd=REPO_ROOT, capture_output=True, text=True, timeout=60, env=env)
    text = " ".join(h.stdout.split())                           # argparse wraps lines
    assert h.returncode == 0 and "no authentication" in text and "127.0.0.1" in text
    bad = subprocess.run([sys.executable, "-m", "runtime.cli", "rpc-server", "--port", "70000"],
                         cwd=REPO_ROOT, capture_output=True, text=True, timeout=60, env=env)
    assert bad.returncode != 0 and "out of range" in bad.stderr and "Traceback" not in bad.stderr
    server = start_rpc_server(rpc_build.lib_dir, tmp_path / "s.log")
    assert f"on 127.0.0.1:{server.port}: offering" in server.log()
    assert "WARNING" not in server.log()                       # loopback: no warning
    server.proc.send_signal(2)                                  # Ctrl-C
    assert server.proc.wait(timeout=20) == 130
    assert server.log().rstrip().endswith("rpc-server: stopped (Ctrl-C)")
    exposed = start_rpc_server(rpc_build.lib_dir, tmp_path / "x.log", "--host", "0.0.0.0")
    try:
        assert "WARNING: listening on 0.0.0.0" in exposed.log()
        assert "no authentication" in exposed.log()
    finally:
        exposed.stop()


@pytest.mark.parametrize("slots", [[], ["-np", "2"]], ids=["one-slot", "batched"])
def test_remote_dying_mid_generation_fails_the_request_and_the_server_stays_up(
        rpc_build, rpc_servers, split_model, tmp_path, slots):
    a, b = rpc_servers
    cfg = write_config(tmp_path / "serve.toml", {a.device: "40MiB", b.device: "30MiB"})
    log_path = tmp_path / "serve.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "runtime.cli", "serve", "-m",
                                 str(split_model), "--config", str(cfg), "--port", "0",
                                 "-c", "8192", *slots],
                                cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, env=child_env(rpc_build.lib_dir))
    try:
        base = _wait_ready(proc, log_path)
        body = {"prompt": "the king saw a river", "max_tokens": 3000, "temperature": 0,
                "stream": True}
        events: list[str] = []
        with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=60) as r:
            lines = (ln for ln in r.iter_lines() if ln.startswith("data: "))
            for _ in range(5):
                events.append(next(lines))                     # generating
            t_kill = time.monotonic()
            b.proc.kill()                                      # the remote dies
            events.extend(lines)
            t_end = time.monotonic()
        assert t_end - t_kill < 30, "the request did not fail within 30 s"
        assert events[-1] != "data: [DONE]"
        error = json.loads(events[-1][6:])["error"]
        assert error["code"] == "remote_device_down" and b.device in error["message"]
        assert proc.poll() is None, "the server process died"
        health = httpx.get(f"{base}/health", timeout=10)
        assert health.status_code == 503
        assert health.json()["devices"] == {a.device: "up", b.device: "down"}
        metrics = httpx.get(f"{base}/metrics", timeout=10).text
        assert f'moe_rpc_device_up{{device="{b.device}"}} 0' in metrics
        assert f'moe_rpc_device_up{{device="{a.device}"}} 1' in metrics
        again = httpx.post(f"{base}/v1/completions", timeout=30,
                           json={"prompt": "hi", "max_tokens": 4, "temperature": 0})
        assert again.status_code == 503 and again.json()["error"]["code"] == "remote_device_down"
        residency = httpx.get(f"{base}/v1/residency", timeout=10).json()
        assert {d["device"]: d["status"] for d in residency["remote"]["devices"]} == {
            a.device: "up", b.device: "down"}
        assert proc.poll() is None
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
    assert "Traceback" not in log_path.read_text(errors="replace")


def _wait_ready(proc: subprocess.Popen, log_path: Path) -> str:
    deadline = time.monotonic() + 180
    port = None
    while time.monotonic() < deadline:
        text = log_path.read_text(errors="replace")
        if proc.poll() is not None:
            raise AssertionError(f"server exited ({proc.returncode}):\n{text}")
        if port is None:
            m = re.search(r"listening on http://127\.0\.0\.1:(\d+)", text)
            port = int(m.group(1)) if m else None
        if port is not None:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    return f"http://127.0.0.1:{port}"
            except httpx.TransportError:
                pass
        time.sleep(0.2)
    raise AssertionError("server not ready:\n" + log_path.read_text(errors="replace"))



def test_a_remote_that_goes_silent_fails_within_the_link_timeout(
        rpc_build, rpc_servers, split_model, tmp_path):
    import signal

    a, b = rpc_servers
    cfg = tmp_path / "silent.toml"
    cfg.write_text(f'[devices]\n"{a.device}" = "40MiB"\n"{b.device}" = "30MiB"\n'
                   "[rpc]\ntimeout_s = 3\n")
    proc = subprocess.Popen([sys.executable, "-m", "runtime.cli", "complete", "-m",
                             str(split_model), "--config", str(cfg), "-p", "the king", "-n",
                             "100000", "-c", "8192", "--temp", "0"], cwd=REPO_ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=child_env(rpc_build.lib_dir))
    try:
        assert proc.stdout.read(64)                      # generating
        b.proc.send_signal(signal.SIGSTOP)               # alive, but silent
        t0 = time.monotonic()
        _out, err = proc.communicate(timeout=60)
        elapsed = time.monotonic() - t0
    finally:
        b.proc.send_signal(signal.SIGCONT)
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 1 and "Traceback" not in err
    assert f"moe-offload: error: {b.device}: remote device lost" in err
    assert elapsed < 3 + 10, f"took {elapsed:.1f} s with a 3 s link timeout"
