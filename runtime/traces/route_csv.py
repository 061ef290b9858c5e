"""Read and write the ``route_trace v1`` long CSV (format: ``tests/runtime/traces/data/README.md``).

    # route_trace v1
    # model=PATH arch=ARCH n_layer=N n_expert=E n_expert_used=K
    # layer=L expert_bytes=B dense_bytes=D          (one line per layer, 0..N-1)
    # pool=I capacity_bytes=C layers=L1,L2,...       (optional: the recording device's pools)
    turn,phase,step,layer,slot,expert,weight,residency,expert_bytes
    0,0,0,0,0,49,0.221297,0,3059712                 (one row per routed expert)

Reading parses the rows with numpy in one pass; only when that fails does a slow line-by-line
scan run, to name the first bad line. Every problem is a ``UserError`` of one line naming the
file and (where there is one) the line number.
"""
from __future__ import annotations

import io
import os
import re
from pathlib import Path

import numpy as np

from runtime.atomic_write import atomic_write
from runtime.errors import UserError
from runtime.traces.trace import RouteTrace, TraceHeader, check_rows

MAGIC_LINE = "# route_trace v1"
HEADER_LINE = "turn,phase,step,layer,slot,expert,weight,residency,expert_bytes"
_MODEL_RE = re.compile(
    r"^# model=(?P<model>.*) arch=(?P<arch>\S+) n_layer=(?P<n_layer>\d+) "
    r"n_expert=(?P<n_expert>\d+) n_expert_used=(?P<n_expert_used>\d+)\s*$")
_LAYER_RE = re.compile(r"^# layer=(\d+) expert_bytes=(\d+) dense_bytes=(\d+)\s*$")
_POOL_RE = re.compile(r"^# pool=(\d+) capacity_bytes=(\d+) layers=(\d+(?:,\d+)*)\s*$")
# CSV column -> (RouteTrace column, numpy dtype used while parsing)
_CSV_COLUMNS = (("turn", "i8"), ("phase", "i8"), ("step", "i8"), ("layer", "i8"),
                ("slot", "i8"), ("expert", "i8"), ("weight", "f8"), ("residency", "i8"),
                ("recorded_bytes", "i8"))


def looks_like_route_csv(path: str | os.PathLike) -> bool:
    """True when the file starts with the ``route_trace v1`` magic line."""
    try:
        with open(path, "rb") as f:
            return f.read(len(MAGIC_LINE)) == MAGIC_LINE.encode()
    except OSError:
        return False


def read_route_csv(path: str | os.PathLike) -> RouteTrace:
    """Parse a ``route_trace v1`` CSV into a validated ``RouteTrace``."""
    name = str(path)
    try:
        raw = Path(path).read_bytes()
    except OSError as exc:
        raise UserError(f"{name}: cannot read ({exc.strerror or exc})") from None
    if not raw.strip():
        raise UserError(f"{name}: empty file")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw[: exc.start].count(b"\n") + 1
        raise UserError(f"{name}: line {line}: not UTF-8 text") from None
    if "\r" in text:
        text = text.replace("\r\n", "\n")     # files written on Windows
    lines = text.split("\n")
    header, body_start = _parse_preamble(name, lines)
    body = lines[body_start:]
    while body and not body[-1].strip():
        body.pop()
    if not body:
        raise UserError(f"{name}: no routing rows after the header (line {body_start})")
    cols = _parse_rows(name, body, first_line=body_start + 1)
    check_rows(header, cols, lambda i: f"{name}: line {body_start + 1 + i}", source=name)
    return RouteTrace(header=header, source=name, **cols)


def _parse_preamble(name: str, lines: list[str]) -> tuple[TraceHeader, int]:
    """Return the header and the 0-based index of the first data line."""
    if lines[0].strip() != MAGIC_LINE:
        raise UserError(f"{name}: line 1: expected '{MAGIC_LINE}', got '{lines[0][:60]}'")
    model = None
    layers: dict[int, tuple[int, int]] = {}
    pools: list[dict] = []
    i = 1
    while i < len(lines) and lines[i].startswith("#"):
        line = lines[i].rstrip("\r")
        if line.startswith("# model="):
            m = _MODEL_RE.match(line)
            if not m:
                raise UserError(f"{name}: line {i + 1}: malformed model line (expected "
                                "'# model=PATH arch=ARCH n_layer=N n_expert=E n_expert_used=K')")
            model = m
        elif line.startswith("# pool="):
            m = _POOL_RE.match(line)
            if not m or int(m.group(1)) != len(pools):
                raise UserError(f"{name}: line {i + 1}: malformed pool line (expected "
                                f"'# pool={len(pools)} capacity_bytes=C layers=L1,L2,...')")
            pools.append({"capacity_bytes": int(m.group(2)),
                          "layers": [int(x) for x in m.group(3).split(",")]})
        elif line.startswith("# layer="):
            m = _LAYER_RE.match(line)
            if not m:
                raise UserError(f"{name}: line {i + 1}: malformed layer line (expected "
                                "'# layer=L expert_bytes=B dense_bytes=D')")
            layer = int(m.group(1))
            if layer in layers:
                raise UserError(f"{name}: line {i + 1}: layer {layer} described twice")
            layers[layer] = (int(m.group(2)), int(m.group(3)))
        i += 1  # other comment lines are free text
    if model is None:
        raise UserError(f"{name}: no '# model=... n_layer=...' line before the header")
    n_layer = int(model.group("n_layer"))
    missing = [layer for layer in range(n_layer) if layer not in layers]
    extra = [layer for layer in layers if layer >= n_layer]
    if missing or extra:
        what = f"no '# layer={missing[0]}' line" if missing else \
            f"'# layer={extra[0]}' beyond n_layer={n_layer}"
        raise UserError(f"{name}: {what} in the preamble")
    if i >= len(lines):
        raise UserError(f"{name}: line {i + 1}: missing column header '{HEADER_LINE}'")
    if lines[i].strip() != HEADER_LINE:
        raise UserError(f"{name}: line {i + 1}: wrong column header (expected '{HEADER_LINE}')")
    try:
        header = TraceHeader(
            model=model.group("model"), arch=model.group("arch"), n_layer=n_layer,
            n_expert=int(model.group("n_expert")),
            n_expert_used=int(model.group("n_expert_used")),
            expert_bytes=tuple(layers[layer][0] for layer in range(n_layer)),
            dense_bytes=tuple(layers[layer][1] for layer in range(n_layer)), pools=tuple(pools))
    except ValueError as exc:
        raise UserError(f"{name}: bad model facts in the preamble ({exc})") from None
    return header, i + 1


def _parse_rows(name: str, body: list[str], first_line: int) -> dict[str, np.ndarray]:
    rows = _loadtxt(body)
    if rows is None:
        _raise_first_bad_line(name, body, first_line)
    if len(rows) != len(body):  # numpy skips blank lines; a blank line inside is malformed
        _raise_first_bad_line(name, body, first_line)
    return {col: rows[col] for col, _ in _CSV_COLUMNS}


_DTYPE = np.dtype([(col, dt) for col, dt in _CSV_COLUMNS])
_INT_FIELD = re.compile(r"\s*[+-]?[0-9]+\s*", re.ASCII)
_FLOAT_FIELD = re.compile(r"\s*[+-]?(?:(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][+-]?[0-9]+)?"
                          r"|inf|infinity|nan)\s*", re.ASCII | re.IGNORECASE)
_INT_FIELDS = {0, 1, 2, 3, 4, 5, 7, 8}


def _loadtxt(lines: list[str]) -> np.ndarray | None:
    """The rows parsed by numpy, or None when it refuses them."""
    try:
        return np.loadtxt(io.StringIO("\n".join(lines)), delimiter=",", dtype=_DTYPE, ndmin=1,
                          comments=None)
    except (ValueError, OverflowError):
        return None


def _raise_first_bad_line(name: str, body: list[str], first_line: int) -> None:
    """Raise a UserError naming the first line numpy cannot parse, and why."""
    for i, line in enumerate(body):
        fields = line.rstrip("\r").split(",")
        where = f"{name}: line {first_line + i}"
        if len(fields) != len(_CSV_COLUMNS):
            raise UserError(f"{where}: expected {len(_CSV_COLUMNS)} comma-separated fields, "
                            f"got {len(fields)}")
        for j, field in enumerate(fields):
            col = _CSV_COLUMNS[j][0]
            if j in _INT_FIELDS:
                if not _INT_FIELD.fullmatch(field):
                    raise UserError(f"{where}: {col} {field[:30]!r} is not an integer")
                if not -2**63 <= int(field) < 2**63:
                    raise UserError(f"{where}: {col} {field.strip()[:30]} is out of range (more than 64 bits)")
            elif not _FLOAT_FIELD.fullmatch(field):
                raise UserError(f"{where}: {col} {field[:30]!r} is not a number")
    # every field looks right, yet numpy refused: halve until one line is left
    lo, hi = 0, len(body)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if _loadtxt(body[lo:mid]) is None or len(_loadtxt(body[lo:mid])) != mid - lo:
            hi = mid
        else:
            lo = mid
    raise UserError(f"{name}: line {first_line + lo}: not a row of numbers "
                    f"({body[lo][:60]!r})")


def format_rows(trace: RouteTrace, start: int = 0, stop: int | None = None) -> str:
    """The CSV rows ``start:stop`` of ``trace`` as text (each row ends with a newline).

    Weights are written as the shortest decimal that reads back to the same float32.
    """
    sl = slice(start, stop)
    cols = [trace.turn[sl].tolist(), trace.phase[sl].tolist(), trace.step[sl].tolist(),
            trace.layer[sl].tolist(), trace.slot[sl].tolist(), trace.expert[sl].tolist(),
            [str(w) for w in trace.weight[sl]], trace.residency[sl].tolist(),
            trace.recorded_bytes[sl].tolist()]
    return "".join(f"{a},{b},{c},{d},{e},{f},{g},{h},{k}\n" for a, b, c, d, e, f, g, h, k
                   in zip(*cols))


def format_preamble(header: TraceHeader) -> str:
    """Preamble and column header lines for ``header``."""
    out = [MAGIC_LINE,
           f"# model={header.model} arch={header.arch} n_layer={header.n_layer} "
           f"n_expert={header.n_expert} n_expert_used={header.n_expert_used}"]
    out += [f"# pool={i} capacity_bytes={p.capacity_bytes} "
            f"layers={','.join(map(str, p.layers))}" for i, p in enumerate(header.pools)]
    out += [f"# layer={layer} expert_bytes={eb} dense_bytes={db}"
            for layer, (eb, db) in enumerate(zip(header.expert_bytes, header.dense_bytes))]
    out.append(HEADER_LINE)
    return "\n".join(out) + "\n"


def write_route_csv(trace: RouteTrace, path: str | os.PathLike) -> None:
    """Write ``trace`` as ``route_trace v1`` CSV (atomically: runtime.atomic_write)."""
    with atomic_write(path, "w") as f:
        f.write(format_preamble(trace.header))
        chunk = 1 << 16
        for start in range(0, len(trace), chunk):
            f.write(format_rows(trace, start, start + chunk))
