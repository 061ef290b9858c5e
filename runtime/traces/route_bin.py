"""A compact binary routing-trace format of our own (``.rtb``), memory-mappable with numpy.

Layout (all integers little endian):

    offset 0   8 bytes   magic  b"MOEROUTE"
    offset 8   u32       format version (2; version 1 files are still read)
    offset 12  u32       H = length of the JSON header in bytes
    offset 16  H bytes   JSON header, UTF-8 (below)
    ...        zero padding to the first column's offset
    columns    one contiguous array per column, each starting at a 64-byte aligned offset,
               the last one zero-padded to a multiple of 64 bytes
    footer     20 bytes (version 2 only): b"MOERTEND", u64 B = bytes before the footer (the
               whole file but the footer), u32 CRC-32 (zlib.crc32) of those B bytes

The JSON header holds the model facts (``TraceHeader.to_json()``: model, arch, n_layer,
n_expert, n_expert_used, expert_bytes and dense_bytes per layer) plus

    "n_rows": N,
    "columns": {"turn": {"dtype": "<i4", "offset": O}, ...}   # every name in trace.COLUMNS

A column named in ``columns`` holds N elements of its dtype at its offset. Readers verify the
footer first (a version 2 file that is truncated, extended or has any flipped bit is refused in
one line: CRC-32 detects every single-bit and every burst error up to 32 bits), then reject an
unknown version, a missing column, a dtype other than the one in ``trace.COLUMNS`` and a file
too short for its columns. Version 1 has no footer: ``integrity()`` says "no checksum". The
rows are the same rows, in the same order, as in the CSV.
"""
from __future__ import annotations

import json
import os
import struct
import zlib

import numpy as np

from runtime.atomic_write import atomic_write
from runtime.errors import UserError
from runtime.traces.trace import COLUMNS, RouteTrace, TraceHeader, check_rows

MAGIC = b"MOEROUTE"
VERSION = 2                 # what this build writes
READS = (1, 2)              # what it reads: 1 has no checksum footer
ALIGN = 64
_PREFIX = struct.Struct("<8sII")  # magic, version, header length
FOOTER_MAGIC = b"MOERTEND"
_FOOTER = struct.Struct("<8sQI")  # magic, bytes before the footer, their CRC-32
_CHUNK = 1 << 22                   # bytes per CRC-32 read


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
    """Map a binary trace read-only; the columns are views of the mapping (no copy). A corrupt
    or truncated file is a one-line ``UserError``."""
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
            if version not in READS:
                raise UserError(f"{name}: unsupported binary trace version {version} "
                                f"(this build reads {', '.join(map(str, READS))})")
            body = _verify_footer(name, f, size) if version >= 2 else size
            if _PREFIX.size + hlen > body:
                raise UserError(f"{name}: truncated header ({body - _PREFIX.size} of {hlen} "
                                f"bytes)")
            f.seek(_PREFIX.size)
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
        specs = {col: (layout[col]["dtype"], int(layout[col]["offset"])) for col in COLUMNS}
    except (ValueError, KeyError, TypeError, OverflowError, AttributeError) as exc:
        raise UserError(f"{name}: bad JSON header ({type(exc).__name__}: {exc})") from None
    if n_rows <= 0:
        raise UserError(f"{name}: no routing rows")
    data = np.memmap(path, mode="r", dtype=np.uint8)
    cols: dict[str, np.ndarray] = {}
    for col, dtype in COLUMNS.items():
        got, start = specs[col]
        if got != dtype:
            raise UserError(f"{name}: column '{col}' missing or not of dtype {dtype}")
        stop = start + n_rows * np.dtype(dtype).itemsize
        if start < _PREFIX.size + hlen or stop > body:
            raise UserError(f"{name}: truncated (column '{col}' ends at byte {stop}, "
                            f"file has {body})" if start >= 0 and stop > body else
                            f"{name}: column '{col}' at byte {start} overlaps the header")
        cols[col] = data[start:stop].view(dtype)
    check_rows(header, cols, lambda i: f"{name}: row {i + 1}", source=name)
    return RouteTrace(header=header, source=name, **cols)


def integrity(path: str | os.PathLike) -> str:
    """What protects the file: "intact (...)" for a version 2 file whose checksum matches
    (UserError when it does not), "no checksum (...)" for version 1."""
    name = str(path)
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            prefix = f.read(_PREFIX.size)
            if len(prefix) < _PREFIX.size or prefix[:8] != MAGIC:
                raise UserError(f"{name}: not a binary route trace")
            version = _PREFIX.unpack(prefix)[1]
            if version < 2:
                return f"no checksum (format version {version}, written before checksums)"
            body = _verify_footer(name, f, size)
    except OSError as exc:
        raise UserError(f"{name}: cannot read ({exc.strerror or exc})") from None
    return f"intact (CRC-32 of {body:,} bytes verified)"


def _verify_footer(name: str, f, size: int) -> int:
    """Bytes before the footer, after checking the footer and the CRC-32 of those bytes."""
    if size < _PREFIX.size + _FOOTER.size:
        raise UserError(f"{name}: truncated ({size} bytes, no checksum footer)")
    f.seek(size - _FOOTER.size)
    magic, body, crc = _FOOTER.unpack(f.read(_FOOTER.size))
    if magic != FOOTER_MAGIC:
        raise UserError(f"{name}: truncated or corrupt (no checksum footer at its end)")
    if body != size - _FOOTER.size:
        raise UserError(f"{name}: truncated or corrupt (the footer counts {body} bytes before "
                        f"it, the file has {size - _FOOTER.size})")
    f.seek(0)
    got, left = 0, body
    while left:
        chunk = f.read(min(_CHUNK, left))
        if not chunk:
            raise UserError(f"{name}: truncated while reading")
        got = zlib.crc32(chunk, got)
        left -= len(chunk)
    if got != crc:
        raise UserError(f"{name}: corrupt (CRC-32 {got:08x} of its contents, the footer says "
                        f"{crc:08x})")
    return body


def seal(f) -> None:
    """Append the checksum footer to ``f`` (open for reading and writing, its body complete)."""
    body = f.seek(0, os.SEEK_END)
    f.seek(0)
    crc = 0
    while chunk := f.read(_CHUNK):
        crc = zlib.crc32(chunk, crc)
    f.seek(body)
    f.write(_FOOTER.pack(FOOTER_MAGIC, body, crc))


def write_route_bin(trace: RouteTrace, path: str | os.PathLike) -> None:
    """Write ``trace`` in the binary format (atomically: runtime.atomic_write)."""
    head, layout = encode_header(trace.header, len(trace))
    with atomic_write(path, "w+b") as f:
        f.write(head)
        for col in COLUMNS:
            f.seek(layout[col]["offset"])
            f.write(np.ascontiguousarray(getattr(trace, col)).tobytes())
        f.truncate(_align(f.tell()))
        seal(f)


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN
