"""Open and save routing traces in either format, chosen by content (reading) or suffix."""
from __future__ import annotations

import os
from pathlib import Path

from runtime.errors import UserError
from runtime.traces.route_bin import integrity, looks_like_route_bin, read_route_bin, \
    write_route_bin
from runtime.traces.route_csv import read_route_csv, write_route_csv
from runtime.traces.trace import RouteTrace

CSV_SUFFIXES = (".csv",)


def read_trace(path: str | os.PathLike) -> RouteTrace:
    """Read a ``route_trace v1`` CSV or a binary ``.rtb`` trace (told apart by the magic)."""
    p = Path(path)
    if not p.exists():
        raise UserError(f"{path}: no such file")
    if p.is_dir():
        raise UserError(f"{path}: is a directory, not a trace file")
    if looks_like_route_bin(p):
        return read_route_bin(p)
    return read_route_csv(p)


def trace_integrity(path: str | os.PathLike) -> str:
    """Whether the file is known intact: "intact (...)" (a verified checksum) or "no checksum
    (...)"; UserError for a checksum that does not match."""
    if looks_like_route_bin(path):
        return integrity(path)
    return "no checksum (CSV)"


def is_csv_path(path: str | os.PathLike) -> bool:
    """True when ``path`` names a CSV trace (``.csv`` suffix); anything else is binary."""
    return Path(path).suffix.lower() in CSV_SUFFIXES


def write_trace(trace: RouteTrace, path: str | os.PathLike) -> None:
    """Write ``trace`` as CSV when ``path`` ends in ``.csv``, else in the binary format."""
    if is_csv_path(path):
        write_route_csv(trace, path)
    else:
        write_route_bin(trace, path)
