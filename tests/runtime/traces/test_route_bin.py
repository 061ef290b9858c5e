"""Binary .rtb traces: lossless against CSV, memory-mapped, and strict about bad files."""
from __future__ import annotations

import json
import struct

import numpy as np
import pytest

from runtime.errors import UserError
from runtime.traces import route_bin
from runtime.traces.files import read_trace, write_trace
from runtime.traces.route_csv import write_route_csv
from runtime.traces.trace import COLUMNS


def test_csv_bin_csv_is_byte_identical(real_trace_path, tmp_path):
    trace = read_trace(real_trace_path)
    write_trace(trace, tmp_path / "t.rtb")
    back = read_trace(tmp_path / "t.rtb")
    assert back.header == trace.header
    for col in COLUMNS:
        assert np.array_equal(getattr(back, col), getattr(trace, col)), col
    write_route_csv(back, tmp_path / "t.csv")
    assert (tmp_path / "t.csv").read_bytes() == real_trace_path.read_bytes()


def test_columns_are_views_of_a_read_only_mapping(real_trace_path, tmp_path):
    write_trace(read_trace(real_trace_path), tmp_path / "t.rtb")
    trace = read_trace(tmp_path / "t.rtb")
    assert isinstance(trace.expert.base, np.memmap) or isinstance(trace.expert, np.memmap)
    assert not trace.expert.flags.writeable
    with pytest.raises(ValueError):
        trace.expert[0] = 1


def test_documented_layout(real_trace_path, tmp_path):
    trace = read_trace(real_trace_path)
    path = tmp_path / "t.rtb"
    write_trace(trace, path)
    raw = path.read_bytes()
    magic, version, hlen = struct.unpack_from("<8sII", raw)
    assert (magic, version) == (b"MOEROUTE", 1)
    meta = json.loads(raw[16:16 + hlen])
    assert meta["n_rows"] == len(trace)
    assert meta["expert_bytes"] == list(trace.header.expert_bytes)
    for col, dtype in COLUMNS.items():
        spec = meta["columns"][col]
        assert spec["dtype"] == dtype and spec["offset"] % 64 == 0
        arr = np.frombuffer(raw, dtype=dtype, count=len(trace), offset=spec["offset"])
        assert np.array_equal(arr, getattr(trace, col))


@pytest.fixture
def rtb(real_trace_path, tmp_path):
    path = tmp_path / "t.rtb"
    write_trace(read_trace(real_trace_path), path)
    return path


def test_truncated_file(rtb):
    data = rtb.read_bytes()
    rtb.write_bytes(data[: len(data) // 2])
    with pytest.raises(UserError, match=r"t.rtb: truncated \(column '\w+' ends at byte"):
        read_trace(rtb)


def test_truncated_header(rtb):
    rtb.write_bytes(rtb.read_bytes()[:40])
    with pytest.raises(UserError, match=r"t.rtb: truncated header"):
        read_trace(rtb)


def test_wrong_version(rtb):
    data = bytearray(rtb.read_bytes())
    data[8:12] = struct.pack("<I", 7)
    rtb.write_bytes(bytes(data))
    with pytest.raises(UserError, match=r"t.rtb: unsupported binary trace version 7"):
        read_trace(rtb)


def test_bad_json_header(rtb):
    data = bytearray(rtb.read_bytes())
    data[16] = ord("]")
    rtb.write_bytes(bytes(data))
    with pytest.raises(UserError, match=r"t.rtb: bad JSON header"):
        read_trace(rtb)


def test_ids_beyond_the_model_name_the_row(rtb):
    trace = read_trace(rtb)
    raw = bytearray(rtb.read_bytes())
    hlen = struct.unpack_from("<I", raw, 12)[0]
    offset = json.loads(raw[16:16 + hlen])["columns"]["expert"]["offset"]
    struct.pack_into("<h", raw, offset + 2 * 5, trace.header.n_expert)  # row 6
    rtb.write_bytes(bytes(raw))
    with pytest.raises(UserError, match=rf"t.rtb: row 6: expert={trace.header.n_expert} out "
                                        rf"of range"):
        read_trace(rtb)


def test_empty_file(tmp_path):
    path = tmp_path / "e.rtb"
    path.write_bytes(b"")
    with pytest.raises(UserError, match=r"e.rtb: empty file"):
        read_trace(path)
    with pytest.raises(UserError, match=r"e.rtb: empty file"):
        route_bin.read_route_bin(path)


def test_missing_file(tmp_path):
    with pytest.raises(UserError, match=r"nope.rtb: no such file"):
        read_trace(tmp_path / "nope.rtb")
