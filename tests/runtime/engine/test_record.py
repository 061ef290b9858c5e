"""``moe-offload trace record`` writes a trace the traces reader loads: every prompt token of
every MoE layer in prefill, every decoded token tagged decode, turns from a chat file; and the
recorded trace replays end to end."""
from __future__ import annotations

import json

import numpy as np
import pytest

from runtime.traces.files import read_trace
from runtime.traces.trace import PHASE_DECODE, PHASE_PREFILL

ARGS = ["-c", "512", "-t", "1", "--temp", "0"]


@pytest.mark.parametrize("suffix", [".rtb", ".csv"])
def test_record_writes_a_complete_trace(tiny_model, tiny_spec, prompt, cli, tmp_path,
                                        make_settings, suffix):
    from runtime.engine.engine import Engine

    out = tmp_path / f"trace{suffix}"
    proc = cli("trace", "record", "-m", str(tiny_model), "-p", prompt, "-n", "8",
               "-o", str(out), *ARGS)
    assert proc.returncode == 0, proc.stderr
    trace = read_trace(out)
    with Engine(make_settings(tiny_model, manage_residency=False), progress=False) as engine:
        n_prompt = len(engine.tokenize(prompt))
    k, layers = tiny_spec.top_k, tiny_spec.layers
    assert trace.header.n_layer == layers and trace.header.n_expert_used == k
    pre = trace.phase == PHASE_PREFILL
    dec = trace.phase == PHASE_DECODE
    assert pre.sum() == n_prompt * layers * k
    assert dec.sum() == 7 * layers * k           # 8 generated, the last is never decoded
    for layer in range(layers):
        steps = trace.step[pre & (trace.layer == layer)]
        np.testing.assert_array_equal(np.unique(steps), np.arange(n_prompt))
        dsteps = np.unique(trace.step[dec & (trace.layer == layer)])
        np.testing.assert_array_equal(dsteps, np.arange(n_prompt, n_prompt + 7))
    assert (trace.expert >= 0).all() and (trace.expert < tiny_spec.experts).all()
    # slot order: weights descending within each routed token
    w = trace.weight.reshape(-1, k)
    assert (np.diff(w, axis=1) <= 0).all()
    np.testing.assert_allclose(w.sum(axis=1), 1.0, rtol=1e-5)   # qwen3moe renormalises
    assert f"to {out}" in proc.stderr


def test_record_chat_file_turns_and_replay(tiny_model, cli, tmp_path):
    turns = tmp_path / "turns.txt"
    turns.write_text("Hello there\n\nWhat is the sea\n", encoding="utf-8")
    out = tmp_path / "chat.rtb"
    proc = cli("trace", "record", "-m", str(tiny_model), "-f", str(turns), "--chat", "-n", "6",
               "-o", str(out), *ARGS)
    assert proc.returncode == 0, proc.stderr
    trace = read_trace(out)
    assert set(np.unique(trace.turn)) == {0, 1}
    # the second turn's prompt reuses the cached first turn: its steps continue after it
    assert trace.step[trace.turn == 1].min() > trace.step[trace.turn == 0].min()
    replay = cli("replay", str(out), "--capacity", "25%", "--policy", "lru", "--json")
    assert replay.returncode == 0, replay.stderr
    cells = json.loads(replay.stdout)
    total = sum(cells[0][p]["accesses"] for p in ("prefill", "decode"))
    assert total == len(trace)


def test_record_bad_input(tiny_model, cli, tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_text("\n", encoding="utf-8")
    for args, needle in [
        (["-f", str(empty), "--chat"], "empty prompt file"),
        (["-p", "x", "-o", str(tmp_path / "no" / "dir.rtb")], "does not exist"),
    ]:
        if "-o" not in args:
            args = [*args, "-o", str(tmp_path / "x.rtb")]
        proc = cli("trace", "record", "-m", str(tiny_model), *args, *ARGS)
        assert proc.returncode != 0
        assert needle in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "x.rtb").exists()
