"""rpc:HOST:PORT devices in a residency config, and the remote plan (pure: no remote)."""
from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest

from runtime.errors import UserError
from runtime.residency.config import parse_config
from runtime.device_names import parse_rpc_device
from runtime.rpc.plan import LayerBytes, Link, plan_remotes
from runtime.rpc.probe import RemoteUnreachable, probe
from tests.conftest import free_port

REPO_ROOT = Path(__file__).resolve().parents[3]


def test_endpoints_parse_to_canonical_names():
    d = parse_rpc_device("rpc:192.168.1.20:50052")
    assert (d.host, d.port, d.index, d.endpoint, d.name) == (
        "192.168.1.20", 50052, 0, "192.168.1.20:50052", "rpc:192.168.1.20:50052")
    d = parse_rpc_device("rpc:gpu-box.lan:6000/1")
    assert (d.host, d.port, d.index, d.name) == ("gpu-box.lan", 6000, 1, "rpc:gpu-box.lan:6000/1")
    assert parse_rpc_device("rpc:127.0.0.1:1/0").name == "rpc:127.0.0.1:1"
    assert parse_rpc_device("rpc:127.0.0.1:1").loopback


@pytest.mark.parametrize("text, needle", [
    ("rpc:127.0.0.1", "malformed endpoint"),
    ("rpc::50052", "no host"),
    ("rpc:127.0.0.1:0", "port 0 is out of range"),
    ("rpc:127.0.0.1:70000", "port 70000 is out of range"),
    ("rpc:127.0.0.1:http", "is not a number"),
    ("rpc:127.0.0.1:50052/x", "device number"),
    ("rpc:bad_host!:50052", "not a host name"),
])
def test_bad_endpoints_are_one_line_errors(text, needle):
    with pytest.raises(UserError) as err:
        parse_config({"devices": {text: "1GiB"}}, source="cfg.toml")
    message = str(err.value)
    assert "\n" not in message and needle in message and message.startswith("cfg.toml: devices.")


def test_config_keeps_remotes_apart_from_managed_devices():
    cfg = parse_config({"devices": {"cpu": "1GiB", "rpc:10.0.0.2:50052": "80%",
                                    "rpc:10.0.0.3:50052/1": "auto", "rpc:10.0.0.4:1": "12GiB"},
                        "rpc": {"mode": "experts", "timeout_s": 5}}, source="c")
    assert [b.device for b in cfg.devices] == ["cpu"]
    assert [b.device for b in cfg.remotes] == ["rpc:10.0.0.2:50052", "rpc:10.0.0.3:50052/1",
                                               "rpc:10.0.0.4:1"]
    assert cfg.remotes[0].share == 0.8 and cfg.remotes[1].auto and cfg.remotes[1].share == 0.8
    assert cfg.remotes[2].bytes == 12 * 2**30
    assert (cfg.rpc_mode, cfg.rpc_timeout_s) == ("experts", 5.0)
    with pytest.raises(UserError, match="rpc.mode"):
        parse_config({"rpc": {"mode": "fastest"}}, source="c")
    with pytest.raises(UserError, match="named twice"):
        parse_config({"devices": {"rpc:10.0.0.2:50052": "1GiB", "rpc:10.0.0.2:50052/0": "1GiB"}},
                     source="c")


def test_probe_of_a_closed_port_names_the_remote():
    dev = parse_rpc_device(f"rpc:127.0.0.1:{free_port()}")
    with pytest.raises(RemoteUnreachable) as err:
        probe(dev, timeout=1.0)
    assert dev.name in str(err.value) and "unreachable" in str(err.value)


def test_probe_of_a_silent_listener_times_out():
    with socket.socket() as s:           # accepts (backlog) but never answers HELLO
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        dev = parse_rpc_device(f"rpc:127.0.0.1:{s.getsockname()[1]}")
        with pytest.raises(RemoteUnreachable, match="did not answer within 0.5 s"):
            probe(dev, timeout=0.5)


def test_config_check_of_an_unreachable_remote_is_one_line(tmp_path):
    cfg = tmp_path / "remote.toml"
    port = free_port()
    cfg.write_text(f'[devices]\n"rpc:127.0.0.1:{port}" = "1GiB"\n')
    r = subprocess.run([sys.executable, "-m", "runtime.cli", "config", "check", str(cfg)],
                       cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "Traceback" not in r.stderr
    assert r.stderr.strip().count("\n") == 0
    assert f"rpc:127.0.0.1:{port}: unreachable" in r.stderr


LAYERS = [LayerBytes(experts=1000, dense=200, kv=50, one_expert=125) for _ in range(8)]


def _links(*caps, rtt=1e-4, bw=1e9):
    return [Link(f"rpc:10.0.0.{i}:1", c, rtt, bw, 6e10) for i, c in enumerate(caps)]


def test_layer_plan_fills_each_budget_from_the_end():
    plan = plan_remotes(LAYERS, _links(3000, 2600), mode="layers", n_expert_used=2, n_embd=64,
                        local_bps=6e10)
    assert [s.layers for s in plan.shares] == [(4, 5), (6, 7)]
    assert all(s.bytes <= s.capacity for s in plan.shares)
    assert plan.local_layers == (0, 1, 2, 3)


def test_expert_plan_places_more_layers_in_the_same_budgets():
    plan = plan_remotes(LAYERS, _links(3000, 2600), mode="experts", n_expert_used=2, n_embd=64,
                        local_bps=6e10)
    assert [s.layers for s in plan.shares] == [(3, 4, 5), (6, 7)]
    assert [s.bytes for s in plan.shares] == [3000, 2000]


def test_auto_picks_by_the_link_model():
    # a fast link: one crossing per range (layers) beats one per layer (experts)
    fast = plan_remotes(LAYERS, _links(3000, 2600), n_expert_used=2, n_embd=64, local_bps=6e10)
    assert fast.mode == "layers"
    costs = dict(fast.costs)
    assert costs["layers"] < costs["experts"]
    # a budget below one whole layer but above its experts: only expert tensors fit
    small = plan_remotes(LAYERS, _links(1100, 1100), n_expert_used=2, n_embd=64, local_bps=6e10)
    assert small.mode == "experts" and "only experts fit" in small.reason
    # whole layers fit, but far fewer bytes than expert sets would: the budgets win over speed
    relief = plan_remotes(LAYERS, _links(2100, 2100), n_expert_used=2, n_embd=64,
                          local_bps=6e10)      # one whole layer (1250) or two expert sets each
    assert relief.mode == "experts" and "under 75% of that" in relief.reason
    assert dict(relief.costs)["layers"] < dict(relief.costs)["experts"]
    # more latency makes the expert plan's per-layer crossings dearer still
    slow = plan_remotes(LAYERS, _links(3000, 2600, rtt=5e-3), mode="experts", n_expert_used=2,
                        n_embd=64, local_bps=6e10)
    assert dict(slow.costs)["experts"] - dict(fast.costs)["experts"] > 4 * 5e-3


def test_cache_plan_keeps_every_layer_local_and_gives_the_slots_the_budget_less_compute():
    plan = plan_remotes(LAYERS, _links(3000), mode="cache", n_expert_used=2, n_embd=64,
                        local_bps=6e10, reserve_bytes={"layers": 900, "experts": 400})
    assert plan.mode == "cache" and plan.local_layers == tuple(range(8))
    (share,) = plan.shares
    assert share.layers == () and share.bytes == 3000 - 400 and share.capacity == 3000
    assert "expert slots" in plan.describe()


def test_a_budget_that_holds_nothing_is_one_line():
    with pytest.raises(UserError, match="holds no layer"):
        plan_remotes(LAYERS, _links(100), mode="layers", n_expert_used=2, n_embd=64,
                     local_bps=6e10)


def test_buffers_llama_cpp_allocated_are_checked_against_the_budget():
    from runtime.rpc.plan import RemotePlan, RemoteShare
    from runtime.rpc.setup import RemoteSetup

    plan = RemotePlan("layers", (RemoteShare("rpc:127.0.0.1:5000", (6, 7), 30 * 2**20,
                                             40 * 2**20),), tuple(range(6)))
    setup = RemoteSetup(plan, (), (), None, ())
    lines = ["load_tensors: RPC0[127.0.0.1:5000] model buffer size =    20.30 MiB",
             "llama_kv_cache: RPC0[127.0.0.1:5000] KV buffer size =     0.75 MiB",
             "sched_reserve:        CPU compute buffer size =     8.01 MiB"]
    setup.verify_buffers(lines + ["sched_reserve: RPC0[127.0.0.1:5000] compute buffer size = "
                                  "    7.51 MiB"])
    assert setup.allocated == {"rpc:127.0.0.1:5000": int(28.56 * 2**20)}
    with pytest.raises(UserError) as err:
        setup.verify_buffers(lines + ["sched_reserve: RPC0[127.0.0.1:5000] compute buffer "
                                      "size =    43.51 MiB"])
    assert str(err.value).startswith("rpc:127.0.0.1:5000: llama.cpp needs 64.6 MiB there")
    assert "above its budget of 40.0 MiB" in str(err.value)


def test_without_a_build_rpc_server_says_how_to_make_one(tmp_path):
    import os

    env = dict(os.environ, MOE_OFFLOAD_NATIVE_DIR=str(tmp_path / "no-builds"))
    env.pop("LLAMA_CPP_LIB_PATH", None)
    r = subprocess.run([sys.executable, "-m", "runtime.cli", "rpc-server", "--port", "0"],
                       cwd=REPO_ROOT, capture_output=True, text=True, timeout=60, env=env)
    assert r.returncode != 0 and "Traceback" not in r.stderr
    assert "out of range" in r.stderr                  # port 0 is refused first
    r = subprocess.run([sys.executable, "-m", "runtime.cli", "rpc-server", "--port",
                        str(free_port())], cwd=REPO_ROOT, capture_output=True, text=True,
                       timeout=60, env=env)
    assert r.returncode != 0 and "Traceback" not in r.stderr
    assert "`moe-offload native build`" in r.stderr and r.stderr.strip().count("\n") == 0
