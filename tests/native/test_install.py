"""The one llama.cpp: CMAKE_ARGS picks the install's backend as with llama-cpp-python, a run
without a current build says in one line which command makes it (before loading anything),
and ``moe-offload native status`` says which build runs."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from runtime.errors import UserError
from runtime.native.install import request_from_cmake_args
from tests.native.conftest import REPO


def _cli(*args: str, **env_changes: str | None) -> subprocess.CompletedProcess:
    """``moe-offload ARGS`` in a child, LLAMA_CPP_LIB_PATH unset unless given (this process
    may have set it by loading llama.cpp), other variables as given (None: unset)."""
    env = dict(os.environ)
    for name in ("LLAMA_CPP_LIB_PATH", "MOE_OFFLOAD_NATIVE_DIR"):
        env.pop(name, None)
    for name, value in env_changes.items():
        if value is None:
            env.pop(name, None)
        else:
            env[name] = value
    return subprocess.run([sys.executable, "-m", "runtime.cli", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("variable", ["MOE_OFFLOAD_CACHE", "MOE_OFFLOAD_NATIVE_DIR"])
def test_a_run_without_a_build_names_the_command_before_loading(tiny_model, tmp_path,
                                                                 variable):
    empty = tmp_path / "empty"
    empty.mkdir()
    proc = _cli("complete", "-m", str(tiny_model), "-p", "hello", "-n", "4",
                **{variable: str(empty)})
    assert proc.returncode == 1, (proc.returncode, proc.stderr)
    assert proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert lines[0].startswith("moe-offload: error: ") and "`moe-offload native build`" in lines[0]
    assert "llama_model_load" not in proc.stderr and "load_tensors" not in proc.stderr
    assert list(empty.iterdir()) == []                 # nothing written, nothing compiled


@pytest.mark.parametrize("text, backend, extra", [
    ("", "cpu", ()),
    ("-DGGML_CUDA=on", "cuda", ()),
    ("-DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90", "cuda", ("-DCMAKE_CUDA_ARCHITECTURES=90",)),
    ("-DGGML_VULKAN=ON", "vulkan", ()),
    ("-DGGML_VULKAN:BOOL=1 -DGGML_AVX512=OFF", "vulkan", ("-DGGML_AVX512=OFF",)),
    ("-DGGML_CUDA=off -DGGML_BLAS=ON", "cpu", ("-DGGML_BLAS=ON",)),
    ("-DGGML_HIP=off -DGGML_NATIVE=OFF", "cpu", ("-DGGML_HIP=off", "-DGGML_NATIVE=OFF")),
])
def test_cmake_args_pick_the_backend(text, backend, extra):
    req = request_from_cmake_args(text)
    assert (req.backend, req.extra_cmake_args, req.rpc) == (backend, extra, True)


def test_cmake_args_of_the_environment(monkeypatch):
    monkeypatch.setenv("CMAKE_ARGS", "-DGGML_VULKAN=on")
    assert request_from_cmake_args().backend == "vulkan"
    monkeypatch.delenv("CMAKE_ARGS")
    assert request_from_cmake_args().backend == "cpu"


@pytest.mark.parametrize("arg", ["-DGGML_HIP=on", "-DGGML_METAL=ON", "-DGGML_SYCL=1"])
def test_cmake_args_for_a_backend_we_do_not_build_are_refused(arg):
    with pytest.raises(UserError) as err:
        request_from_cmake_args(f"-DGGML_NATIVE=OFF {arg}")
    message = str(err.value)
    assert "\n" not in message and arg in message and "cpu, cuda, vulkan" in message


def test_native_build_refuses_them_in_one_line(tmp_path):
    # a source that is not there: were CMAKE_ARGS not refused first, this fails, not compiles
    proc = _cli("native", "build", "--source", str(tmp_path / "none"), CMAKE_ARGS="-DGGML_HIP=on")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.count("\n") == 1 and "-DGGML_HIP=on" in proc.stderr


def test_status_says_which_build_is_in_use(llama_build):
    proc = _cli("native", "status", "--json")
    assert proc.returncode == 0, proc.stderr
    status = json.loads(proc.stdout)
    assert status["in_use"] == status["dir"] == llama_build.lib_dir
    assert status["in_use_from"] == "install"
    assert status["installed_backend"] == llama_build.backend
    text = _cli("native", "status").stdout
    assert f"in use: {llama_build.lib_dir} (this install's {llama_build.backend} build)" in text

    # LLAMA_CPP_LIB_PATH wins, as it does for every command; status says so
    other = _cli("native", "status", LLAMA_CPP_LIB_PATH="/opt/other-llama/lib").stdout
    assert (f"in use: /opt/other-llama/lib ($LLAMA_CPP_LIB_PATH; this install's build: "
            f"{llama_build.lib_dir})") in other


def test_status_without_a_build_names_the_command(tmp_path):
    proc = _cli("native", "status", MOE_OFFLOAD_NATIVE_DIR=str(tmp_path))
    assert proc.returncode == 0
    assert "built: no" in proc.stdout and "in use:" not in proc.stdout
    assert "`moe-offload native build`" in proc.stdout
    status = json.loads(_cli("native", "status", "--json",
                             MOE_OFFLOAD_NATIVE_DIR=str(tmp_path)).stdout)
    assert status["in_use"] is None and status["in_use_from"] is None
