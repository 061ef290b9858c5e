"""``moe-offload inspect`` and ``moe-offload synth`` run as a user runs them (subprocess)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from gguf_tools.synth import SynthSpec
from tests.conftest import write_dense_gguf

REPO = Path(__file__).resolve().parents[2]


def moe_offload(*args: str | Path, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-m", "runtime.cli", *map(str, args)],
                          capture_output=True, text=True, timeout=timeout, env=env, cwd=REPO)


def assert_one_line_error(result: subprocess.CompletedProcess[str], *fragments: str) -> None:
    assert result.returncode != 0
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


def test_inspect_json_keys_and_values(tiny_model: Path, tiny_spec: SynthSpec) -> None:
    result = moe_offload("inspect", tiny_model, "--json")
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert data["arch"] == "qwen3moe"
    assert data["n_layer"] == tiny_spec.layers
    assert data["n_expert"] == tiny_spec.experts
    assert data["n_expert_used"] == tiny_spec.top_k
    assert data["n_embd"] == tiny_spec.embd and data["n_ff_exp"] == tiny_spec.ff
    assert data["moe_layers"] == list(range(tiny_spec.layers))
    one_expert = 3 * tiny_spec.embd * tiny_spec.ff * 4          # gate, up, down in f32
    assert data["expert_bytes"] == [one_expert] * tiny_spec.layers
    assert data["total_expert_bytes"] == one_expert * tiny_spec.layers * tiny_spec.experts
    assert data["file_bytes"] == tiny_model.stat().st_size
    assert 0 < data["dense_bytes"] < data["file_bytes"] - data["total_expert_bytes"] + 1
    assert data["expert_types"][0] == {"gate": "F32", "up": "F32", "down": "F32"}


def test_inspect_table(tiny_model: Path) -> None:
    result = moe_offload("inspect", tiny_model)
    assert result.returncode == 0, result.stderr
    assert "arch qwen3moe, 4 layers, 8 experts (top-2)" in result.stdout
    assert "MoE layers: 0-3 (4 of 4)" in result.stdout
    assert "24,576" in result.stdout          # bytes of one f32 expert: 3 * 64 * 32 * 4


def test_inspect_bad_inputs(tmp_path: Path, tiny_model: Path) -> None:
    data = tiny_model.read_bytes()
    cases = {
        "missing": (tmp_path / "nope.gguf", "no such file"),
        "directory": (tmp_path, "is a directory"),
        "not gguf": (tmp_path / "notes.txt", "not a GGUF file"),
        "empty": (tmp_path / "empty.gguf", "not a GGUF file"),
        "cut in metadata": (tmp_path / "head.gguf", "truncated or corrupt GGUF"),
        "cut in data": (tmp_path / "cut.gguf", "truncated GGUF file"),
        "dense": (write_dense_gguf(tmp_path / "dense.gguf"), "not a mixture-of-experts model"),
    }
    (tmp_path / "notes.txt").write_text("just some text\n")
    (tmp_path / "empty.gguf").write_bytes(b"")
    (tmp_path / "head.gguf").write_bytes(data[:3000])
    (tmp_path / "cut.gguf").write_bytes(data[: len(data) // 2])
    before = {p: p.stat().st_mtime_ns for p in tmp_path.iterdir() if p.is_file()}
    for label, (path, message) in cases.items():
        result = moe_offload("inspect", path)
        assert_one_line_error(result, str(path), message)
    # inspect never writes: every file is as it was
    assert before == {p: p.stat().st_mtime_ns for p in tmp_path.iterdir() if p.is_file()}


def test_synth_writes_a_model_inspect_reads(tmp_path: Path) -> None:
    out = tmp_path / "m.gguf"
    result = moe_offload("synth", out, "--arch", "gpt-oss", "--layers", "2", "--experts", "4",
                         "--top-k", "2", "--dtype", "q8_0", "--skew", "1.0", "--seed", "3")
    assert result.returncode == 0, result.stderr
    assert "wrote" in result.stdout
    data = json.loads(moe_offload("inspect", out, "--json").stdout)
    assert (data["arch"], data["n_layer"], data["n_expert"], data["n_expert_used"]) == (
        "gpt-oss", 2, 4, 2)
    assert data["expert_types"][1]["gate"] == "Q8_0"
    assert data["expert_types"][1]["down.bias"] == "F32"


@pytest.mark.parametrize(("args", "message"), [
    (["--top-k", "9", "--experts", "8"], "--top-k 9 is more than --experts 8"),
    (["--dtype", "q4_0", "--ff", "48"], "blocks of 32"),
    (["--dtype", "q4_k_m"], "blocks of 256"),
    (["--experts", "0"], "--experts must be at least 1"),
])
def test_synth_refuses_impossible_shapes(tmp_path: Path, args: list[str], message: str) -> None:
    out = tmp_path / "m.gguf"
    result = moe_offload("synth", out, *args)
    assert_one_line_error(result, str(out), message)
    assert list(tmp_path.iterdir()) == []      # nothing written, not even a temporary file


def test_synth_bad_destination(tmp_path: Path) -> None:
    assert_one_line_error(moe_offload("synth", tmp_path), "is a directory")
    missing = tmp_path / "no" / "m.gguf"
    assert_one_line_error(moe_offload("synth", missing), "does not exist")


def test_synth_deepseek2_dense_first_and_shared_experts(tmp_path: Path) -> None:
    out = tmp_path / "ds.gguf"
    result = moe_offload("synth", out, "--arch", "deepseek2", "--layers", "3",
                         "--dense-layers", "1", "--gate-up-merged", "--quiet")
    assert result.returncode == 0, result.stderr
    assert result.stdout == ""
    data = json.loads(moe_offload("inspect", out, "--json").stdout)
    assert data["moe_layers"] == [1, 2]
    assert data["expert_bytes"][0] == 0 and data["expert_bytes"][1] > 0
    assert data["n_shared_experts"] == 1                    # the CLI's default for deepseek2
    assert data["expert_types"][1] == {"gate_up": "F32", "down": "F32"}
    table = moe_offload("inspect", out).stdout
    assert "MoE layers: 1-2 (2 of 3)" in table and "dense" in table
