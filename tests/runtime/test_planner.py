"""``moe-offload plan``: budgets from free memory (dense weights and KV cache first), a TOML
that passes ``config check`` and runs, and a one-line error when the dense part cannot fit."""
from __future__ import annotations

import subprocess
import sys
import tomllib

import pytest

from runtime.planner import RAM_RESERVE, RESERVE_FOR_ONE_USE, DeviceMemory, plan
from runtime.ramtier import one_use_room, split_budget
from tests.runtime.engine.conftest import run_cli

GIB = 1 << 30


@pytest.fixture(scope="module")
def cli():
    return run_cli


def test_plan_without_a_gpu_budgets_ram_after_dense_and_kv(tiny_model, cli, tmp_path):
    from gguf_tools.facts import read_model_facts

    facts = read_model_facts(tiny_model)
    # RAM for the dense part, KV and the reserve, and half the experts
    free = facts.dense_bytes + 4096 * 1000 + RAM_RESERVE + facts.total_expert_bytes // 2
    got = plan(facts, [DeviceMemory("cpu", free, free)], ctx=1000, kv_per_token=4096)
    (cpu,) = got.devices
    assert cpu.device == "cpu" and got.gpu_layers == 0
    # half the experts kept, and one layer's one-use room lent by the reserve (the tier keeps
    # budget - room: runtime/ramtier split_budget)
    room = one_use_room(facts)[0]
    lent = min(room, int(RAM_RESERVE * RESERVE_FOR_ONE_USE))
    assert cpu.budget_bytes == facts.total_expert_bytes // 2 + lent
    assert split_budget(cpu.budget_bytes, facts.total_expert_bytes, 0, room).kept \
        == facts.total_expert_bytes // 2
    roomy = plan(facts, [DeviceMemory("cpu", 64 * GIB, 64 * GIB)], ctx=1000, kv_per_token=4096)
    assert roomy.devices[0].budget_bytes == facts.total_expert_bytes   # never above all experts

    out = tmp_path / "plan.toml"
    done = cli("plan", "-m", str(tiny_model), "-c", "512", "--free", f"cpu={free}",
               "-o", str(out))
    assert done.returncode == 0, done.stderr
    # its lines start as every other command's (moe-offload: ...)
    assert done.stderr.splitlines() == [f"moe-offload: wrote {out} (run with -ngl 0 --config "
                                        f"{out})"]
    cfg = tomllib.loads(out.read_text())
    assert cfg["policy"]["decode"]["eviction"] == "next-visit"
    budget = int(cfg["devices"]["cpu"].rstrip("B"))
    assert 0 < budget <= facts.total_expert_bytes
    assert all(ln.startswith("#") or "=" in ln or ln.startswith("[") or not ln.strip()
               for ln in out.read_text().splitlines())
    check = cli("config", "check", str(out), "-m", str(tiny_model))
    assert check.returncode == 0, check.stderr
    ran = cli("complete", "-m", str(tiny_model), "-p", "hello", "-n", "4", "-c", "512",
              "-t", "1", "--temp", "0", "--config", str(out))
    assert ran.returncode == 0, ran.stderr


def test_plan_with_a_gpu_puts_dense_and_kv_there(tiny_model):
    from gguf_tools.facts import read_model_facts

    facts = read_model_facts(tiny_model)
    gpu_free = facts.dense_bytes + 1000 * 4096 + GIB
    got = plan(facts, [DeviceMemory("cuda:0", gpu_free, gpu_free),
                       DeviceMemory("cpu", 8 * GIB, 16 * GIB)], ctx=1000, kv_per_token=4096)
    assert got.gpu_layers == 99 and got.devices[0].device == "cuda:0"
    assert got.devices[0].budget_bytes == min(GIB - GIB // 2, facts.total_expert_bytes)


def test_dense_weights_over_free_memory_is_one_line(tiny_model, cli):
    done = cli("plan", "-m", str(tiny_model), "--free", "cpu=1MiB")
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"moe-offload: error: {tiny_model}: dense ")
    assert "of RAM with its reserve, only 1.00 MiB available" in lines[0]
    bad = cli("plan", "-m", str(tiny_model), "--free", "cpu")
    assert bad.returncode == 2 and "--free: expected DEVICE=SIZE" in bad.stderr


def test_complete_auto_plans_at_load(tiny_model, cli, tmp_path):
    args = ["complete", "-m", str(tiny_model), "-p", "hello", "-n", "4", "-c", "512", "-t", "1",
            "--temp", "0"]
    plain = cli(*args)
    auto = cli(*args, "--auto")
    assert plain.returncode == 0 and auto.returncode == 0, auto.stderr
    assert auto.stdout == plain.stdout
    chosen = [line for line in auto.stderr.splitlines() if line.startswith("moe-offload: --auto")]
    assert chosen[0].startswith("moe-offload: --auto: --devices.cpu ")      # what it chose
    assert "of experts): cpu: " in chosen[0] and chosen[-1] == "moe-offload: --auto: -ngl 0"
    cfg = tmp_path / "c.toml"
    cfg.write_text("")
    both = cli(*args, "--auto", "--config", str(cfg))
    assert both.returncode == 2
    assert both.stderr.strip().splitlines()[-1] == (
        "moe-offload: error: --auto plans the residency config itself: give --auto or "
        "--config, not both")


def test_auto_leaves_the_library_choice_to_the_engine(tiny_model):
    """`--auto` plans before the engine loads: measuring the GPUs must not load llama.cpp in
    this process (that would fix the library before the engine picks the patched build its
    budgets need: the RAM tier's lazy experts, the device cache)."""
    code = ("import argparse, sys\n"
            "from runtime.commands.engine_args import add_engine_args, settings_from_args\n"
            "p = argparse.ArgumentParser(); add_engine_args(p)\n"
            f"s = settings_from_args(p.parse_args(['-m', {str(tiny_model)!r}, '--auto',"
            " '-c', '512']))\n"
            "assert s.config is not None, s\n"
            "print('llama_cpp' in sys.modules)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "False"
