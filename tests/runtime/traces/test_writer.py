"""TraceWriter: incremental appends give the same file as writing the whole trace at once."""
from __future__ import annotations

import numpy as np
import pytest

from runtime.errors import UserError
from runtime.traces.files import read_trace, write_trace
from runtime.traces.synthetic import SynthTraceSpec, synthesize
from runtime.traces.trace import COLUMNS
from runtime.traces.writer import TraceWriter

SPEC = SynthTraceSpec(n_layer=3, n_expert=16, top_k=4, prompt_tokens=10, decode_tokens=5,
                      chunk=4, seed=3, expert_bytes=(1000, 2000, 3000))


def _append_by_batches(writer: TraceWriter, trace) -> None:
    bounds = trace.batch_bounds()
    k = trace.header.n_expert_used
    for s, e in zip(bounds[:-1], bounds[1:]):
        writer.append_batch(turn=int(trace.turn[s]), phase=int(trace.phase[s]),
                            layer=int(trace.layer[s]), first_step=int(trace.step[s]),
                            experts=trace.expert[s:e].reshape(-1, k),
                            weights=trace.weight[s:e].reshape(-1, k))


@pytest.mark.parametrize("name", ["w.rtb", "w.csv"])
def test_incremental_equals_whole(tmp_path, name):
    trace = synthesize(SPEC)
    whole = tmp_path / f"whole-{name}"
    write_trace(trace, whole)
    with TraceWriter(tmp_path / name, trace.header) as w:
        _append_by_batches(w, trace)
    assert w.rows_written == len(trace)
    assert (tmp_path / name).read_bytes() == whole.read_bytes()
    back = read_trace(tmp_path / name)
    for col in COLUMNS:
        assert np.array_equal(getattr(back, col), getattr(trace, col)), col
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([name, whole.name])


def test_exception_inside_leaves_no_file(tmp_path):
    trace = synthesize(SPEC)
    with pytest.raises(RuntimeError):
        with TraceWriter(tmp_path / "x.rtb", trace.header) as w:
            _append_by_batches(w, trace)
            raise RuntimeError("capture failed")
    assert list(tmp_path.iterdir()) == []


def test_bad_ids_are_refused_and_nothing_is_published(tmp_path):
    header = synthesize(SPEC).header
    w = TraceWriter(tmp_path / "x.csv", header)
    w.append_batch(turn=0, phase=0, layer=0, first_step=0, experts=[[1, 2, 3, 4]],
                   weights=[[0.4, 0.3, 0.2, 0.1]])
    with pytest.raises(UserError, match=r"x.csv: row 6: expert=16 out of range"):
        w.append_batch(turn=0, phase=0, layer=1, first_step=0, experts=[[1, 16, 3, 4]],
                       weights=[[0.4, 0.3, 0.2, 0.1]])
    w.abort()
    assert list(tmp_path.iterdir()) == []


def test_closing_an_empty_capture_is_an_error(tmp_path):
    w = TraceWriter(tmp_path / "x.rtb", synthesize(SPEC).header)
    with pytest.raises(UserError, match=r"x.rtb: no routing rows were captured"):
        w.close()
    assert list(tmp_path.iterdir()) == []


def test_steps_and_recorder_columns(tmp_path):
    header = synthesize(SPEC).header
    with TraceWriter(tmp_path / "x.rtb", header) as w:
        w.append_batch(turn=1, phase=1, layer=2, first_step=0, steps=[7],
                       experts=[[5, 6, 7, 8]], weights=[[0.4, 0.3, 0.2, 0.1]],
                       residency=[[1, 0, 2, 0]], recorded_bytes=[[0, 3000, 0, 3000]])
    t = read_trace(tmp_path / "x.rtb")
    assert t.step.tolist() == [7] * 4 and t.turn.tolist() == [1] * 4
    assert t.slot.tolist() == [0, 1, 2, 3]
    assert t.residency.tolist() == [1, 0, 2, 0]
    assert t.recorded_bytes.tolist() == [0, 3000, 0, 3000]
