"""Fixtures for the native tests: the patched build (this install's, tests/conftest.py) and a
helper that runs tests/native/native_child.py in a subprocess with a chosen libllama."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from gguf_tools.synth import SynthSpec

CHILD = Path(__file__).with_name("native_child.py")
REPO = Path(__file__).resolve().parents[2]
# 16 experts, top-4, q8_0: several experts per token, quantized slots
Q8_SPEC = SynthSpec(arch="qwen3moe", layers=4, experts=16, top_k=4, embd=128, ff=64,
                    dtype="q8_0", seed=1, skew=1.0)


@pytest.fixture(scope="session")
def native_build(llama_build):
    """This install's patched build (with the RPC backend, as every build by default): the
    one the native tests and tests/runtime/rpc run on; never a second CPU build."""
    return llama_build


@pytest.fixture(scope="session")
def q8_model(synth_model_factory) -> Path:
    return synth_model_factory(Q8_SPEC)


def skip_without_vulkan_toolchain() -> None:
    """pytest.skip, saying why, unless lavapipe and a --backend vulkan toolchain are here
    (scripts/vulkan_toolchain.sh installs both; CI runs it)."""
    import glob

    from runtime.errors import UserError
    from runtime.native import vulkan_sdk

    if not glob.glob("/usr/share/vulkan/icd.d/lvp_icd.*.json"):
        pytest.skip("no lavapipe (mesa-vulkan-drivers): run scripts/vulkan_toolchain.sh")
    try:
        vulkan_sdk.resolve()
    except UserError as exc:
        pytest.skip(str(exc))


def run_child(mode: str, args: dict, lib_dir: str | None, timeout: float = 300) -> dict:
    """Run native_child.py MODE with LLAMA_CPP_LIB_PATH=lib_dir (None: unset, so the child
    loads whatever library it picks by itself: this install's build)."""
    env = dict(os.environ)
    env.pop("LLAMA_CPP_LIB_PATH", None)
    if lib_dir is not None:
        env["LLAMA_CPP_LIB_PATH"] = lib_dir
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, str(CHILD), mode, json.dumps(args)], env=env,
                          capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise AssertionError(f"child {mode} failed (exit {proc.returncode}):\n"
                             f"{proc.stderr[-3000:]}")
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    result["stderr"] = proc.stderr
    return result
