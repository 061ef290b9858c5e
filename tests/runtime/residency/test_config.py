"""Residency config: TOML parsing, flag overrides, and ``moe-offload config check`` errors."""
from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import pytest

from runtime.errors import UserError
from runtime.residency.config import load_config
from runtime.residency.config_cli import add_config_arguments, config_from_args
from runtime.residency.policies.factory import policy_names
from runtime.residency.types import Phase

FULL = """
[devices]
"cuda:0" = "6GiB"
cpu = "50%"
cpu-slots = "auto"

[policy]
phase_specific = true

[policy.prefill]
admission = "always"
prefetch = "chunk-plan"
eviction = "lru"

[policy.decode]
admission = "reuse-threshold"
admission_params = { break_even = 3 }
prefetch = "none"
eviction = "lfu-decay"
eviction_params = { half_life = 2048 }

[cost]
link_gbps = 12.5
cpu_gflops = 300
"""


def write(tmp_path: Path, text: str, name: str = "cfg.toml") -> Path:
    p = tmp_path / name
    p.write_text(text)
    return p


def test_vulkan_devices(tmp_path):
    from runtime.residency.config import device_kind, is_cache_device, is_gpu

    cfg = load_config(write(tmp_path, '[devices]\n"vulkan:0" = "2GiB"\n"vulkan:1" = "auto"\n'))
    assert cfg.budget("vulkan:0").bytes == 2 * 2**30
    assert cfg.budget("vulkan:1").share == pytest.approx(0.8)
    assert [device_kind(d) for d in ("vulkan:3", "cuda:0", "cpu-slots")] == [
        "vulkan", "cuda", "cpu-slots"]
    assert is_gpu("vulkan:0") and not is_gpu("cpu-slots") and is_cache_device("cpu-slots")
    assert not is_cache_device("cpu")


def test_full_file_parses(tmp_path):
    cfg = load_config(write(tmp_path, FULL))
    assert [b.device for b in cfg.devices] == ["cuda:0", "cpu", "cpu-slots"]
    assert cfg.budget("cuda:0").bytes == 6 * 2**30
    assert cfg.budget("cpu").share == pytest.approx(0.5)
    assert cfg.budget("cpu-slots").auto and cfg.budget("cuda:1").auto
    assert cfg.policies_for(Phase.DECODE).eviction.params == (("half_life", 2048.0),)
    assert cfg.policies_for(Phase.DECODE).admission.params == (("break_even", 3.0),)
    assert cfg.policies_for(Phase.PREFILL).prefetch.name == "chunk-plan"
    assert cfg.policies_for(Phase.MIXED) == cfg.decode
    assert cfg.cost.link_gbps == 12.5 and cfg.cost.cpu_gflops == 300.0
    assert cfg.cost.gpu_mem_gbps == 900.0


def test_phase_agnostic_uses_decode_everywhere(tmp_path):
    cfg = load_config(write(tmp_path, FULL.replace("phase_specific = true",
                                                   "phase_specific = false")))
    assert cfg.policies_for(Phase.PREFILL) == cfg.decode


def test_flags_override_file(tmp_path):
    parser = argparse.ArgumentParser()
    add_config_arguments(parser)
    args = parser.parse_args([
        "--config", str(write(tmp_path, FULL)), "--devices.cuda:0", "2GiB", "--devices.cpu", "1GiB",
        "--policy.decode.eviction", "lru", "--policy.phase_specific", "false",
        "--policy.prefill.eviction_params.half_life", "64", "--policy.prefill.eviction",
        "lfu-decay", "--cost.link_gbps", "7"])
    cfg = config_from_args(args)
    assert cfg.budget("cuda:0").bytes == 2 * 2**30 and cfg.budget("cpu").bytes == 2**30
    assert cfg.decode.eviction.name == "lru" and not cfg.phase_specific
    assert cfg.prefill.eviction.params == (("half_life", 64.0),)
    assert cfg.cost.link_gbps == 7.0 and cfg.cost.cpu_gflops == 300.0
    none = config_from_args(parser.parse_args(["--devices.cuda:3", "1GiB"]))
    assert none.budget("cuda:3").bytes == 2**30 and none.source == "command line"
    with pytest.raises(UserError, match="--cost.link_gbps: must be a number"):
        config_from_args(parser.parse_args(["--cost.link_gbps", "fast"]))


@pytest.mark.parametrize("text,message", [
    ('[devices]\ntpu = "1GiB"\n', "cfg.toml: devices.tpu: unknown device 'tpu'"),
    ('[devices]\n"vulkan:01" = "1GiB"\n', "cfg.toml: devices.vulkan:01: unknown device"),
    ('[devices]\ncpu = "-1GiB"\n', "cfg.toml: devices.cpu: size must be positive"),
    ('[devices]\ncpu = 0\n', "cfg.toml: devices.cpu: size must be positive"),
    ('[devices]\ncpu = "lots"\n', "cfg.toml: devices.cpu: not a size: 'lots'"),
    ('[devices]\ncpu = "120%"\n', "cfg.toml: devices.cpu: percentage must be in"),
    ('[policy.decode]\neviction = "mru"\n',
     "cfg.toml: policy.decode.eviction: unknown eviction policy 'mru' (valid: "
     f"{', '.join(policy_names('eviction'))})"),
    ('[policy.prefill]\nadmission = "never"\n',
     f"valid: {', '.join(policy_names('admission'))})"),
    ('[policy]\nphase_specific = "yes"\n',
     "cfg.toml: policy.phase_specific: must be true or false"),
    ('[policy.decode]\nevict = "lru"\n', "cfg.toml: policy.decode.evict: unknown key"),
    ('[cost]\nlink_gbps = -3\n', "cfg.toml: cost.link_gbps: must be > 0"),
    ('[cost]\nwarp = 9\n', "cfg.toml: cost.warp: unknown key"),
    ('[gpu]\nx = 1\n', "cfg.toml: gpu: unknown section"),
    ("[devices\n", "cfg.toml: not valid TOML"),
])
def test_parse_errors(tmp_path, text, message):
    with pytest.raises(UserError) as err:
        load_config(write(tmp_path, text))
    assert message in str(err.value) and "\n" not in str(err.value)


def cli(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "runtime.cli", *argv], capture_output=True,
                          text=True, timeout=120)


def test_config_check_cli_errors_and_success(tmp_path, tiny_model):
    bad = [
        ('[devices]\ntpu = "1GiB"\n', "devices.tpu"),
        ('[policy.decode]\neviction = "mru"\n',
         f"valid: {', '.join(policy_names('eviction'))})"),
        ('[devices]\ncpu = "nonsense"\n', "devices.cpu"),
        ('[devices]\ncpu = "100000TiB"\n', "above the device's total memory"),
        ('[devices]\ncpu = "16B"\n', "smaller than the model's largest expert"),
        ("not = [toml\n", "not valid TOML"),
    ]
    for i, (text, needle) in enumerate(bad):
        path = write(tmp_path, text, f"bad{i}.toml")
        proc = cli("config", "check", str(path), "-m", str(tiny_model))
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode != 0, text
        assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
        assert str(path) in lines[0] and needle in lines[0], lines[0]
    missing = cli("config", "check", str(tmp_path / "absent.toml"))
    assert missing.returncode != 0 and "absent.toml: no such file" in missing.stderr
    ok = write(tmp_path, '[devices]\ncpu = "64MiB"\n"cuda:0" = "1GiB"\n', "ok.toml")
    proc = cli("config", "check", str(ok), "-m", str(tiny_model))
    assert proc.returncode == 0, proc.stderr
    assert f"devices.cpu = '64MiB': {64 * 2**20} bytes" in proc.stdout
    assert "experts" in proc.stdout and "cuda:0" in proc.stdout
    flag = cli("config", "check", str(ok), "--policy.decode.eviction", "nope")
    assert flag.returncode != 0 and "valid: lru" in flag.stderr
    gpu_share = write(tmp_path, '[devices]\n"cuda:0" = "80%"\n', "share.toml")
    proc = cli("config", "check", str(gpu_share))
    assert proc.returncode != 0 and "devices.cuda:0" in proc.stderr and "6GiB" in proc.stderr


def _one_model_cases():
    """(role, name, its first parameter at its default, at twice that) of every policy that
    keeps one state of its own per core (its registry line's one_model)."""
    from runtime.residency.policies.factory import ROLES, param_defaults, policy_entry

    cases = []
    for role in ROLES:
        for name in policy_names(role):
            if policy_entry(role, name).one_model:
                key, value = next(iter(param_defaults(role, name).items()))
                cases.append(pytest.param(role, name, f"{key} = {value}",
                                          f"{key} = {2 * value}", id=name))
    return cases


@pytest.mark.parametrize("role,name,params,other", _one_model_cases())
def test_a_policy_with_its_own_model_takes_one_setting(tmp_path, role, name, params, other):
    """lfu-decay's decay, next-visit's and affinity's models are one per core: the phases that
    use the policy must agree on its parameters (registry line's `one_model`)."""
    from runtime.residency.core import CorePolicy

    def config(decode_params: str, prefill_params: str = params):
        return load_config(write(tmp_path, f"""
[policy]
phase_specific = true
[policy.prefill]
{role} = "{name}"
{role}_params = {{ {prefill_params} }}
[policy.decode]
{role} = "{name}"
{role}_params = {{ {decode_params} }}
"""))

    def block(pol):                                  # the policy's C parameter block
        return dict(pol.orders + pol.prefetch)[name]

    agreed = CorePolicy.from_config(config(params))
    assert block(agreed) != block(CorePolicy.from_config(config(other, other)))  # from params
    with pytest.raises(UserError, match=f"{role} policy '{name}' must have the same "
                                        "parameters in every phase"):
        CorePolicy.from_config(config(other))
