"""A compact binary routing-trace format of our own (``.rtb``), memory-mappable with numpy.

Layout (all integers little endian):

    offset 0   8 bytes   magic  b"MOEROUTE"
    offset 8   u32       format version (1)
    offset 12  u32       H = length of the JSON header in bytes
    offset 16  H bytes   JSON header, UTF-8 (below)
    ...        zero padding to the first column's offset
    columns    one contiguous array per column, each starting at a 64-byte aligned offset

The JSON header holds the model facts (``TraceHeader.to_json()``: model, arch, n_layer,
n_expert, n_expert_used, expert_bytes and dense_bytes per layer) plus

    "n_rows": N,
    "columns": {"turn": {"dtype": "<i4", "offset": O}, ...}   # every name in trace.COLUMNS

A column named in ``columns`` holds N elements of its dtype at its offset. Readers reject an
unknown version, a missing column, a dtype other than the one in ``trace.COLUMNS`` and a file
too short for its columns. The rows are the same rows, in the same order, as in the CSV.
"""
from __future__ import annotations

import json
import os
import struct

import numpy as np

from runtime.atomic_write import atomic_write
from runtime.errors import UserError
from runtime.traces.trace import COLUMNS, RouteTrace, TraceHeader, check_rows

MAGIC = b"MOEROUTE"
VERSION = 1
ALIGN = 64
_PREFIX = struct.Struct("<8sII")  # magic, version, header length


def looks_like_route_bin(path: str | os.PathLike) -> bool:
    """True when the file starts with the binary trace magic."""
    try:
        with open(path, "rb") as f:
            return f.read(len(MAGIC)) == MAGIC
    except OSError:
        return False


def column_layout(n_rows: int, header_json_len: int) -> dict[str, dict]:
    """Offsets of each column for a file with ``n_rows`` rows and a JSON header of the given
    length (the JSON itself holds these offsets, so callers iterate until the length settles)."""
    offset = _align(_PREFIX.size + header_json_len)
    layout = {}
    for name, dtype in COLUMNS.items():
        layout[name] = {"dtype": dtype, "offset": offset}
        offset = _align(offset + n_rows * np.dtype(dtype).itemsize)
    return layout


def encode_header(header: TraceHeader, n_rows: int) -> tuple[bytes, dict[str, dict]]:
    """The file's first bytes (magic, version, JSON) padded to the first column, and the layout."""
    guess = 0
    while True:
        layout = column_layout(n_rows, guess)
        meta = dict(header.to_json(), n_rows=n_rows, columns=layout)
        blob = json.dumps(meta, separators=(",", ":")).encode("utf-8")
        if len(blob) == guess:
            break
        guess = len(blob)
    first = _PREFIX.pack(MAGIC, VERSION, len(blob)) + blob
    pad = layout[next(iter(COLUMNS))]["offset"] - len(first)
    return first + b"\0" * pad, layout


def read_route_bin(path: str | os.PathLike) -> RouteTrace:
    """Map a binary trace read-only; the columns are views of the mapping (no copy)."""
    name = str(path)
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            prefix = f.read(_PREFIX.size)
            if size == 0:
                raise UserError(f"{name}: empty file")
            if len(prefix) < _PREFIX.size or prefix[:8] != MAGIC:
                raise UserError(f"{name}: not a binary route trace (bad magic {prefix[:8]!r})")
            _, version, hlen = _PREFIX.unpack(prefix)
            if version != VERSION:
                raise UserError(f"{name}: unsupported binary trace version {version} "
                                f"(this build reads {VERSION})")
            blob = f.read(hlen)
    except OSError as exc:
        raise UserError(f"{name}: cannot read ({exc.strerror or exc})") from None
    if len(blob) != hlen:
        raise UserError(f"{name}: truncated header ({len(blob)} of {hlen} bytes)")
    try:
        meta = json.loads(blob.decode("utf-8"))
        header = TraceHeader.from_json(meta)
        n_rows = int(meta["n_rows"])
        layout = meta["columns"]
    except (ValueError, KeyError, TypeError) as exc:
        raise UserError(f"{name}: bad JSON header ({exc})") from None
    if n_rows == 0:
        raise UserError(f"{name}: no routing rows")
    data = np.memmap(path, mode="r", dtype=np.uint8)
    cols: dict[str, np.ndarray] = {}
    for col, dtype in COLUMNS.items():
        spec = layout.get(col)
        if not isinstance(spec, dict) or spec.get("dtype") != dtype:
            raise UserError(f"{name}: column '{col}' missing or not of dtype {dtype}")
        start = int(spec["offset"])
        stop = start + n_rows * np.dtype(dtype).itemsize
        if start < 0 or stop > size:
            raise UserError(f"{name}: truncated (column '{col}' ends at byte {stop}, "
                            f"file has {size})")
        cols[col] = data[start:stop].view(dtype)
    check_rows(header, cols, lambda i: f"{name}: row {i + 1}", source=name)
    return RouteTrace(header=header, source=name, **cols)


def write_route_bin(trace: RouteTrace, path: str | os.PathLike) -> None:
    """Write ``trace`` in the binary format (atomically: a temp file renamed into place)."""
    head, layout = encode_header(trace.header, len(trace))
    with atomic_write(path, "wb") as f:
        f.write(head)
        for col in COLUMNS:
            f.seek(layout[col]["offset"])
            f.write(np.ascontiguousarray(getattr(trace, col)).tobytes())
        f.truncate(_align(f.tell()))


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN
