"""route_trace v1 CSV: real traces read and write back byte for byte; bad input is one line."""
from __future__ import annotations

import numpy as np
import pytest

from runtime.errors import UserError
from runtime.traces.route_csv import read_route_csv, write_route_csv
from runtime.traces.trace import PHASE_DECODE, PHASE_PREFILL


def test_real_trace_round_trips_byte_for_byte(real_trace_path, tmp_path):
    trace = read_route_csv(real_trace_path)
    out = tmp_path / "out.csv"
    write_route_csv(trace, out)
    assert out.read_bytes() == real_trace_path.read_bytes()


def test_real_trace_matches_its_readme(real_trace_path):
    trace = read_route_csv(real_trace_path)
    h = trace.header
    expected = {"qwen3-30b-a3b": ("qwen3moe", 48, 6, 28, 128),
                "gpt-oss-120b": ("gpt-oss", 36, 2, 85, 64)}[real_trace_path.name.split(".")[0]]
    arch, n_layer, k, prompt, decode = expected
    assert (h.arch, h.n_layer, h.n_expert, h.n_expert_used) == (arch, n_layer, 128, k)
    assert trace.token_count(PHASE_PREFILL) == prompt
    assert trace.token_count(PHASE_DECODE) == decode
    # decode routes every layer of every step with k distinct experts
    assert int((trace.phase == PHASE_DECODE).sum()) == decode * n_layer * k
    assert len(trace.header.expert_bytes) == n_layer and min(trace.header.expert_bytes) > 0


def test_small_trace_columns(good_csv_text, tmp_path):
    path = tmp_path / "t.csv"
    path.write_text(good_csv_text)
    t = read_route_csv(path)
    assert len(t) == 10
    assert t.header.expert_bytes == (1000, 2000) and t.header.dense_bytes == (50, 60)
    assert t.expert.tolist() == [1, 2, 1, 3, 0, 2, 3, 0, 0, 1]
    assert t.recorded_bytes.tolist()[:3] == [1000, 1000, 0]
    np.testing.assert_allclose(t.weight[:2], [0.6, 0.4])
    # batches: prefill layer 0 (4 rows), prefill layer 1, decode layer 0, decode layer 1
    assert t.batch_bounds().tolist() == [0, 4, 6, 8, 10]


def _replace_line(text: str, line_no: int, new: str | None) -> str:
    lines = text.split("\n")
    if new is None:
        del lines[line_no - 1]
    else:
        lines[line_no - 1] = new
    return "\n".join(lines)


BAD_ROWS = [
    # (line, replacement, expected fragment)
    (7, "0,0,0,0,1,2,0.4,0", "line 7: expected 9 comma-separated fields, got 8"),
    (8, "0,0,1,0,0,x,0.7,1,0", "line 8: expert 'x' is not an integer"),
    (9, "0,0,1,0,1,3,abc,0,1000", "line 9: weight 'abc' is not a number"),
    (10, "0,0,1,1,0,4,0.5,0,2000", "line 10: expert=4 out of range (model has 4 experts)"),
    (11, "0,0,1,2,1,2,0.5,0,2000", "line 11: layer=2 out of range (model has 2 layers)"),
    (12, "0,1,2,0,2,3,0.9,0,1000", "line 12: slot=2 out of range (n_expert_used=2)"),
    (13, "0,3,2,0,1,0,0.1,0,1000", "line 13: phase=3 out of range"),
    (14, "0,1,-2,1,0,0,0.8,0,2000", "line 14: step=-2 out of range"),
    (15, "0,1,2,1,1,99999,0.2,0,2000", "line 15: expert=99999 out of range"),
    (6, "0,0,0,0,0,1,nan,0,1000", "line 6: weight is not a finite number"),
    (8, "", "line 8: expected 9 comma-separated fields, got 1"),
    # fields Python's int() takes and numpy does not: each was "rows could not be parsed"
    (7, "99999999999999999999,0,0,0,1,2,0.4,0,1000",
     "line 7: turn 99999999999999999999 is out of range (more than 64 bits)"),
    (7, "0,0,0,0,1,2,0.4,0,1_000", "line 7: recorded_bytes '1_000' is not an integer"),
    (7, "0,0,0,0,1,\u0662,0.4,0,1000", "line 7: expert '\u0662' is not an integer"),
    (7, "0,0,0,0,1,2,0.4,0,1000\x00", "line 7: recorded_bytes '1000\\x00' is not an integer"),
    (9, "0,0,1,0,1,3,0.3,0,18446744073709551616", "line 9: recorded_bytes 18446744073709551616"
                                                 " is out of range"),
    (9, "0,0,1,0,1,3,0_1.5,0,1000", "line 9: weight '0_1.5' is not a number"),
    (9, "0,0,1,0,1,3,0.3,0,1000 # c", "line 9: recorded_bytes '1000 # c' is not an integer"),
]


@pytest.mark.parametrize("line,new,fragment", BAD_ROWS)
def test_malformed_rows_name_file_and_line(good_csv_text, tmp_path, line, new, fragment):
    path = tmp_path / "bad.csv"
    path.write_text(_replace_line(good_csv_text, line, new))
    with pytest.raises(UserError) as err:
        read_route_csv(path)
    msg = str(err.value)
    assert msg.startswith(f"{path}: ") and fragment in msg and "\n" not in msg


BAD_PREAMBLES = [
    (1, "# route_trace v2", "line 1: expected '# route_trace v1'"),
    (2, "# model=x arch=qwen3moe n_layer=2", "line 2: malformed model line"),
    (2, None, "no '# model=... n_layer=...' line"),
    (4, None, "no '# layer=1' line"),
    (4, "# layer=2 expert_bytes=2000 dense_bytes=60", "no '# layer=1' line"),
    (4, "# layer=0 expert_bytes=2000 dense_bytes=60", "line 4: layer 0 described twice"),
    (4, "# layer=1 expert_bytes=big dense_bytes=60", "line 4: malformed layer line"),
    (5, "turn,phase,step,layer,slot,expert,weight", "line 5: wrong column header"),
    (2, "# model=x arch=a n_layer=2 n_expert=4 n_expert_used=5", "bad model facts"),
]


@pytest.mark.parametrize("line,new,fragment", BAD_PREAMBLES)
def test_wrong_header_is_one_line(good_csv_text, tmp_path, line, new, fragment):
    path = tmp_path / "bad.csv"
    path.write_text(_replace_line(good_csv_text, line, new))
    with pytest.raises(UserError) as err:
        read_route_csv(path)
    assert str(err.value).startswith(f"{path}: ") and fragment in str(err.value)


def test_layer_without_experts_is_refused(good_csv_text, tmp_path):
    path = tmp_path / "dense.csv"
    path.write_text(good_csv_text.replace("layer=1 expert_bytes=2000", "layer=1 expert_bytes=0"))
    with pytest.raises(UserError, match=r"line 10: layer 1 has no routed experts"):
        read_route_csv(path)


@pytest.mark.parametrize("content,fragment", [
    ("", "empty file"), ("\n\n  \n", "empty file"),
    ("PK\x03\x04junk", "line 1: expected '# route_trace v1'"),
])
def test_empty_or_foreign_file(tmp_path, content, fragment):
    path = tmp_path / "x.csv"
    path.write_text(content)
    with pytest.raises(UserError, match=fragment):
        read_route_csv(path)


def test_header_without_rows(good_csv_text, tmp_path):
    path = tmp_path / "norows.csv"
    path.write_text("\n".join(good_csv_text.split("\n")[:5]) + "\n")
    with pytest.raises(UserError, match=r"norows.csv: no routing rows after the header"):
        read_route_csv(path)


def test_write_is_atomic_on_failure(good_csv_text, tmp_path):
    src = tmp_path / "t.csv"
    src.write_text(good_csv_text)
    trace = read_route_csv(src)
    with pytest.raises(UserError, match="cannot write"):
        write_route_csv(trace, tmp_path / "missing-dir" / "out.csv")
    assert not list((tmp_path).glob("**/*.tmp*"))


def test_windows_line_endings(good_csv_text, tmp_path):
    path = tmp_path / "crlf.csv"
    path.write_bytes(good_csv_text.replace("\n", "\r\n").encode())
    t = read_route_csv(path)
    assert len(t) == 10 and t.header.dense_bytes == (50, 60)
