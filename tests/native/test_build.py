"""The patch series applies to the vendored llama.cpp, the build is cached by content, and
``moe-offload native build|status`` tell the truth."""
from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from runtime.cli import main
from runtime.errors import UserError
from runtime.native.build import (BuildRequest, build, build_key, find_build, patch_files,
                                  read_build)
from runtime.native.install import request_from_cmake_args
from runtime.native.source import resolve_source


def test_patches_apply_in_order_to_the_vendored_source(tmp_path: Path):
    assert [p.name for p in patch_files()] == ["0001-moe-expert-slot-cache.patch",
                                               "0002-ggml-cpu-mul-mat-id-used-matrices.patch",
                                               "0003-ggml-cpu-amx-tile-config.patch",
                                               "0004-rpc-errors-not-abort.patch",
                                               "0005-ggml-vulkan-mmid-prealloc-per-graph.patch",
                                               "0006-lazy-routed-experts.patch",
                                               "0007-ggml-cpu-weight-ready.patch",
                                               "0008-ggml-cpu-barrier-sleeps.patch"]
    source = resolve_source(None)
    tree = tmp_path / "llama.cpp"
    source.extract(tree)
    for patch in patch_files():
        proc = subprocess.run(["patch", "-p1", "--forward", "--batch", "-i", str(patch)],
                              cwd=tree, capture_output=True, text=True)
        assert proc.returncode == 0, proc.stdout + proc.stderr
    graph = (tree / "src" / "llama-graph.cpp").read_text()
    assert "llama_moe_cache_find(down_exps)" in graph and "ffn_moe_cold_ids" in graph
    assert "ffn_moe_pick" in graph and "moe_cache_anchors_ok" not in graph
    assert (tree / "include" / "llama-moe-cache.h").is_file()
    rpc = (tree / "ggml" / "src" / "ggml-rpc" / "ggml-rpc.cpp").read_text()
    assert "ggml_backend_rpc_failure_count" in rpc and "GGML_ABORT(\"Failed to connect" not in rpc
    cpu = (tree / "ggml" / "src" / "ggml-cpu" / "ggml-cpu.c").read_text()
    assert "memset(matrix_row_counts" not in cpu and "used_as" in cpu        # patch 0002
    vulkan = (tree / "ggml" / "src" / "ggml-vulkan" / "ggml-vulkan.cpp").read_text()
    assert "sized for every mmid of" in vulkan                                 # patch 0005
    cpu_h = (tree / "ggml" / "include" / "ggml-cpu.h").read_text()
    assert "ggml_cpu_set_weight_ready" in cpu_h and "weight_ready" in cpu        # patch 0007
    assert "FUTEX_WAIT_PRIVATE" in cpu and "GGML_BARRIER_SPIN" in cpu           # patch 0008


def test_build_is_cached_and_complete(native_build):
    lib = Path(native_build.lib_dir)
    for name in ("libllama.so", "libggml.so", "libggml-base.so", "libggml-cpu.so",
                 "libmoe_device_cache.so", "libggml-rpc.so", "libmtmd.so"):
        assert (lib / name).exists(), name
    nm = subprocess.run(["nm", "-D", "--defined-only", str(lib / "libllama.so")],
                        capture_output=True, text=True).stdout
    assert "llama_moe_cache_register" in nm and "llama_moe_cache_find" in nm
    rpc_nm = subprocess.run(["nm", "-D", "--defined-only", str(lib / "libggml-rpc.so")],
                            capture_output=True, text=True).stdout
    assert "ggml_backend_rpc_start_server" in rpc_nm
    assert "ggml_backend_rpc_failure_count" in rpc_nm        # patch 0004
    assert native_build.rpc is True
    again = build(request_from_cmake_args())   # what the install asked: nothing is rebuilt
    assert again == native_build
    assert read_build(lib.parent).built_at == native_build.built_at
    newest = find_build("cpu")          # the newest current build (any source)
    assert newest is not None and newest.patches_hash == native_build.patches_hash
    assert newest.built_at >= native_build.built_at


def test_key_depends_on_backend_and_flags():
    base = build_key("src", BuildRequest(backend="cpu"))
    assert build_key("src", BuildRequest(backend="cpu")) == base
    assert build_key("other", BuildRequest(backend="cpu")) != base
    cuda = build_key("src", BuildRequest(backend="cuda", cuda_arch="90"))
    assert cuda != base
    assert build_key("src", BuildRequest(backend="cuda", cuda_arch="90", cuda_fa=False)) != cuda
    assert build_key("src", BuildRequest(backend="cpu", native_cpu=False)) != base
    assert build_key("src", BuildRequest(backend="cpu", rpc=False)) != base
    assert build_key("src", BuildRequest(backend="cpu", extra_cmake_args=("-DX=1",))) != base
    # the RPC backend is in every build by default: the install's, the tests', gpu_check's
    assert BuildRequest(backend="cpu").rpc is True


def test_status_json_is_truthful(native_build, capsys):
    assert main(["native", "status", "--json"]) == 0
    status = json.loads(capsys.readouterr().out)
    assert status["built"] is True
    assert "cpu" in status["backends"]
    assert any(b["dir"] == native_build.lib_dir for b in status["builds"])
    assert status["patches"] == [p.name for p in patch_files()]
    assert status["rpc"] is True and status["rpc_dir"] is not None
    assert main(["native", "status"]) == 0
    assert "rpc: yes" in capsys.readouterr().out


def test_status_without_any_build(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("MOE_OFFLOAD_NATIVE_DIR", str(tmp_path / "empty"))
    assert main(["native", "status", "--json"]) == 0
    status = json.loads(capsys.readouterr().out)
    assert status["built"] is False and status["dir"] is None and status["backends"] == []
    assert main(["native", "status"]) == 0
    assert "built: no" in capsys.readouterr().out


@pytest.mark.parametrize("argv, needle", [
    (["native", "build", "--backend", "metal"], "--backend metal: unknown"),
    (["native", "build", "--source", "/no/such/path"], "/no/such/path: no such file"),
    (["native", "build", "-j", "0"], "--jobs 0"),
])
def test_bad_build_input_is_one_line(argv, needle, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert needle in err and err.count("\n") == 1 and "Traceback" not in err


def test_source_that_is_not_llama_cpp(tmp_path):
    (tmp_path / "x.txt").write_text("hello")
    with pytest.raises(UserError, match="not a llama.cpp tree"):
        resolve_source(tmp_path)
    with pytest.raises(UserError, match="not a tar archive"):
        resolve_source(tmp_path / "x.txt")
