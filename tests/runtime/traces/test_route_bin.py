"""Binary .rtb traces: lossless against CSV, memory-mapped, and strict about bad files."""
from __future__ import annotations

import json
import struct
import zlib

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
    assert (magic, version) == (b"MOEROUTE", 2)
    end, body, crc = struct.unpack_from("<8sQI", raw, len(raw) - 20)
    assert (end, body, crc) == (b"MOERTEND", len(raw) - 20, zlib.crc32(raw[:-20]))
    assert body % 64 == 0
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


def reseal(path, data: bytes | bytearray) -> None:
    """Write ``data`` (a file without its footer) with a footer that matches it: what a buggy
    writer would make, so the checks behind the checksum run."""
    with open(path, "w+b") as f:
        f.write(bytes(data))
        route_bin.seal(f)


def as_version_1(path) -> None:
    """Turn a version 2 file into the version 1 layout (no footer)."""
    data = bytearray(path.read_bytes()[:-20])
    data[8:12] = struct.pack("<I", 1)
    path.write_bytes(bytes(data))


def test_truncated_file(rtb):
    data = rtb.read_bytes()
    rtb.write_bytes(data[: len(data) // 2])
    with pytest.raises(UserError, match=r"t.rtb: truncated or corrupt \(no checksum footer"):
        read_trace(rtb)
    reseal(rtb, data[: len(data) // 2])            # a footer that matches the short file
    with pytest.raises(UserError, match=r"t.rtb: truncated \(column '\w+' ends at byte"):
        read_trace(rtb)


def test_truncated_header(rtb):
    reseal(rtb, rtb.read_bytes()[:40])
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
    with pytest.raises(UserError, match=r"t.rtb: corrupt \(CRC-32 [0-9a-f]{8} of its contents"):
        read_trace(rtb)
    reseal(rtb, data[:-20])
    with pytest.raises(UserError, match=r"t.rtb: bad JSON header"):
        read_trace(rtb)


def test_ids_beyond_the_model_name_the_row(rtb):
    trace = read_trace(rtb)
    raw = bytearray(rtb.read_bytes()[:-20])
    hlen = struct.unpack_from("<I", raw, 12)[0]
    offset = json.loads(raw[16:16 + hlen])["columns"]["expert"]["offset"]
    struct.pack_into("<h", raw, offset + 2 * 5, trace.header.n_expert)  # row 6
    reseal(rtb, raw)
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


def test_version_1_files_still_read_without_a_checksum(rtb, capsys):
    from runtime.cli import main
    before = read_trace(rtb)
    as_version_1(rtb)
    after = read_trace(rtb)
    for col in COLUMNS:
        assert np.array_equal(getattr(after, col), getattr(before, col)), col
    assert main(["trace", "info", str(rtb)]) == 0
    out = capsys.readouterr().out
    assert "integrity: no checksum (format version 1" in out


def test_version_1_with_a_column_without_offset_is_one_line(rtb):
    """Was ``KeyError: 'offset'`` and a traceback."""
    as_version_1(rtb)
    raw = rtb.read_bytes()
    hlen = struct.unpack_from("<I", raw, 12)[0]
    text = raw[16:16 + hlen].replace(b'"offset"', b'"offsex"', 1)
    rtb.write_bytes(raw[:16] + text + raw[16 + hlen:])
    with pytest.raises(UserError, match=r"t.rtb: bad JSON header \(KeyError: 'offset'\)"):
        read_trace(rtb)


def test_info_says_intact_and_refuses_a_corrupt_file_in_one_line(rtb, tmp_path, capsys):
    from runtime.cli import main
    assert main(["trace", "info", str(rtb)]) == 0
    assert "integrity: intact (CRC-32 of" in capsys.readouterr().out
    bad = tmp_path / "bad.rtb"
    data = bytearray(rtb.read_bytes())
    data[len(data) // 2] ^= 0x10
    bad.write_bytes(bytes(data))
    assert main(["trace", "info", str(bad), str(rtb)]) == 2
    out, err = capsys.readouterr()
    assert err.count("\n") == 1 and "bad.rtb: corrupt (CRC-32" in err
    assert "t.rtb: " in out and "integrity: intact" in out      # the good file still shown
