"""`moe-offload trace convert / synth / info` through the real CLI entry point."""
from __future__ import annotations

import numpy as np
import pytest

from runtime.cli import main
from runtime.traces.files import read_trace
from runtime.traces.trace import COLUMNS, PHASE_DECODE


def _run(capsys, *argv):
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_convert_both_ways(capsys, real_trace_path, tmp_path):
    code, out, err = _run(capsys, "trace", "convert", real_trace_path, tmp_path / "t.rtb")
    assert code == 0, err
    assert "binary trace" in out
    code, out, err = _run(capsys, "trace", "convert", tmp_path / "t.rtb", tmp_path / "t.csv")
    assert code == 0, err
    assert (tmp_path / "t.csv").read_bytes() == real_trace_path.read_bytes()


def test_convert_refuses_to_overwrite_its_input(capsys, tmp_path, real_trace_path):
    copy = tmp_path / "t.csv"
    copy.write_bytes(real_trace_path.read_bytes())
    code, _, err = _run(capsys, "trace", "convert", copy, copy)
    assert code == 2 and "output is the input file" in err
    assert copy.read_bytes() == real_trace_path.read_bytes()


def test_convert_bad_input_names_file_and_line(capsys, tmp_path):
    bad = tmp_path / "bad.csv"
    bad.write_text("# route_trace v1\n# model=m arch=a n_layer=1 n_expert=2 n_expert_used=1\n"
                   "# layer=0 expert_bytes=10 dense_bytes=0\n"
                   "turn,phase,step,layer,slot,expert,weight,residency,expert_bytes\n"
                   "0,0,0,0,0,1,1.0,0,10\n0,1,1,0,0,2,1.0,0,10\n")
    code, out, err = _run(capsys, "trace", "convert", bad, tmp_path / "o.rtb")
    assert code == 2 and out == ""
    assert err == (f"moe-offload: error: {bad}: line 6: expert=2 out of range "
                   f"(model has 2 experts)\n")
    assert not (tmp_path / "o.rtb").exists()


def test_synth_writes_the_requested_shape(capsys, tmp_path):
    out_path = tmp_path / "s.csv"
    code, out, err = _run(capsys, "trace", "synth", "-o", out_path, "--layers", "5",
                          "--experts", "20", "--top-k", "3", "--prompt", "7", "--decode", "4",
                          "--chunk", "3", "--skew", "1.2", "--reuse", "0.5", "--seed", "9",
                          "--expert-bytes", "2MiB")
    assert code == 0, err
    t = read_trace(out_path)
    h = t.header
    assert (h.n_layer, h.n_expert, h.n_expert_used) == (5, 20, 3)
    assert h.expert_bytes == (2 << 20,) * 5
    assert len(t) == 11 * 5 * 3 and t.token_count(PHASE_DECODE) == 4
    # the same arguments give the same trace
    again = tmp_path / "again.rtb"
    _run(capsys, "trace", "synth", "-o", again, "--layers", "5", "--experts", "20", "--top-k",
         "3", "--prompt", "7", "--decode", "4", "--chunk", "3", "--skew", "1.2", "--reuse",
         "0.5", "--seed", "9", "--expert-bytes", "2MiB")
    t2 = read_trace(again)
    assert all(np.array_equal(getattr(t, c), getattr(t2, c)) for c in COLUMNS)


def test_synth_from_a_model_takes_its_facts(capsys, tmp_path, tiny_model):
    from runtime.traces.model_header import header_from_model
    code, _, err = _run(capsys, "trace", "synth", "-o", tmp_path / "m.rtb", "--model",
                        tiny_model, "--prompt", "4", "--decode", "4")
    assert code == 0, err
    t = read_trace(tmp_path / "m.rtb")
    assert t.header == header_from_model(tiny_model)


@pytest.mark.parametrize("argv,fragment", [
    (["--top-k", "9", "--experts", "8"], "trace synth: need n_layer >= 1"),
    (["--reuse", "1.5"], "trace synth: need skew >= 0 and 0 <= reuse <= 1"),
    (["--expert-bytes", "lots"], "--expert-bytes: not a size"),
    (["--prompt", "0", "--decode", "0"], "at least one token"),
])
def test_synth_bad_arguments(capsys, tmp_path, argv, fragment):
    code, out, err = _run(capsys, "trace", "synth", "-o", tmp_path / "x.rtb", *argv)
    assert code == 2 and fragment in err and err.count("\n") == 1
    assert not (tmp_path / "x.rtb").exists()


def test_info(capsys, real_trace_path):
    code, out, err = _run(capsys, "trace", "info", real_trace_path)
    assert code == 0, err
    assert f"{real_trace_path}: " in out and "decode:" in out and "layer batches:" in out
