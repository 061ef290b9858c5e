"""TraceWriter: write a routing trace incrementally, one layer batch at a time (live capture).

    header = header_from_model("model.gguf")           # runtime.traces.model_header
    with TraceWriter("out.rtb", header) as w:          # ".csv" -> route_trace v1 CSV
        w.append_batch(turn=0, phase=0, layer=3, first_step=0,
                       experts=topk_ids,                 # (n_tokens, k) int, slot order
                       weights=topk_weights)             # (n_tokens, k) float
    # leaving the block closes the file; an exception inside it discards the file

Rows must be appended in execution order (the order replay runs them). Memory stays bounded:
CSV rows stream to the output, binary columns stream to per-column spill files that are joined
into the final file on ``close()``. Output appears atomically (runtime.atomic_write: a temp
file, fsync, rename), so a crashed capture never leaves a half-written trace behind, and the
next writer of the same path removes a killed capture's temp and spill files.
"""
from __future__ import annotations

import os
import shutil
from pathlib import Path

import numpy as np

from runtime.atomic_write import AtomicTarget, write_error
from runtime.errors import UserError
from runtime.traces import route_bin, route_csv
from runtime.traces.files import is_csv_path
from runtime.traces.trace import COLUMNS, RouteTrace, TraceHeader, check_rows


class TraceWriter:
    """Append rows to a trace file; ``close()`` publishes it, ``abort()`` discards it."""

    def __init__(self, path: str | os.PathLike, header: TraceHeader, *,
                 csv: bool | None = None):
        self.path = Path(path)
        self.header = header
        self.csv = is_csv_path(path) if csv is None else csv
        self.rows_written = 0
        self._closed = False
        self._target = AtomicTarget(self.path)    # removes the stale temps of killed writers
        self._tmp = self._target.tmp
        self._spills: dict[str, Path] = {}
        self._files = {}
        try:
            if self.csv:
                self._files["csv"] = open(self._tmp, "w", encoding="utf-8", newline="\n")
                self._files["csv"].write(route_csv.format_preamble(header))
            else:
                for col in COLUMNS:
                    spill = self._target.extra(col)
                    self._spills[col] = spill
                    self._files[col] = open(spill, "wb")
        except OSError as exc:
            self._cleanup()
            raise write_error(self.path, exc) from None

    # -- appending -------------------------------------------------------------------------

    def append_batch(self, *, turn: int, phase: int, layer: int, first_step: int,
                     experts: np.ndarray, weights: np.ndarray,
                     steps: np.ndarray | None = None, residency: np.ndarray | None = None,
                     recorded_bytes: np.ndarray | None = None) -> None:
        """Append one layer batch: ``experts``/``weights`` are (n_tokens, k) in slot order.

        Token t's step is ``first_step + t`` unless ``steps`` (n_tokens,) gives them.
        ``residency``/``recorded_bytes`` (n_tokens, k) describe the recording engine's cache;
        omitted, every row is a recorder miss of the layer's expert bytes.
        """
        experts = np.asarray(experts)
        if experts.ndim != 2:
            raise ValueError(f"experts must be (n_tokens, k), got shape {experts.shape}")
        n_tokens, k = experts.shape
        weights = np.asarray(weights, dtype=np.float32).reshape(n_tokens, k)
        if steps is None:
            steps = first_step + np.arange(n_tokens, dtype=np.int64)
        steps = np.asarray(steps, dtype=np.int64).reshape(n_tokens)
        n = n_tokens * k
        self.append_rows(
            turn=np.full(n, turn), phase=np.full(n, phase), step=np.repeat(steps, k),
            layer=np.full(n, layer), slot=np.tile(np.arange(k), n_tokens),
            expert=experts.reshape(n), weight=weights.reshape(n),
            residency=None if residency is None else np.asarray(residency).reshape(n),
            recorded_bytes=None if recorded_bytes is None else
            np.asarray(recorded_bytes).reshape(n))

    def append_rows(self, *, turn, phase, step, layer, slot, expert, weight,
                    residency=None, recorded_bytes=None) -> None:
        """Append rows given as equal-length 1-D arrays (one element per routed expert)."""
        if self._closed:
            raise ValueError(f"{self.path}: writer already closed")
        cols = {"turn": turn, "phase": phase, "step": step, "layer": layer, "slot": slot,
                "expert": expert, "weight": weight}
        cols = {name: np.asarray(v).reshape(-1) for name, v in cols.items()}
        n = len(cols["layer"])
        if n == 0:
            return
        if residency is None:
            residency = np.zeros(n, dtype=np.int8)
        if recorded_bytes is None:
            recorded_bytes = np.asarray(self.header.expert_bytes, dtype=np.int64)[
                np.clip(cols["layer"], 0, self.header.n_layer - 1)]
        cols["residency"] = np.asarray(residency).reshape(-1)
        cols["recorded_bytes"] = np.asarray(recorded_bytes).reshape(-1)
        if any(len(v) != n for v in cols.values()):
            raise ValueError("append_rows: columns differ in length")
        base = self.rows_written
        check_rows(self.header, cols, lambda i: f"{self.path}: row {base + i + 1}",
                   source=str(self.path))
        try:
            if self.csv:
                part = RouteTrace(header=self.header, **cols)
                self._files["csv"].write(route_csv.format_rows(part))
            else:
                for col, dtype in COLUMNS.items():
                    self._files[col].write(np.ascontiguousarray(cols[col], dtype=dtype).tobytes())
        except OSError as exc:
            self.abort()
            raise write_error(self.path, exc) from None
        self.rows_written += n

    # -- finishing -------------------------------------------------------------------------

    def close(self) -> Path:
        """Finish the file and move it into place; returns its path. Idempotent."""
        if self._closed:
            return self.path
        if self.rows_written == 0:
            self.abort()
            raise UserError(f"{self.path}: no routing rows were captured; nothing written")
        try:
            for f in self._files.values():
                f.close()
            if not self.csv:
                self._join_spills()
        except OSError as exc:
            self.abort()
            raise write_error(self.path, exc) from None
        self._target.publish()          # fsync, rename, fsync the directory; or UserError
        self._cleanup()
        self._closed = True
        return self.path

    def abort(self) -> None:
        """Discard everything written so far. Idempotent."""
        self._closed = True
        self._cleanup()

    def __enter__(self) -> TraceWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()

    def _join_spills(self) -> None:
        head, layout = route_bin.encode_header(self.header, self.rows_written)
        with open(self._tmp, "w+b") as out:
            out.write(head)
            for col in COLUMNS:
                out.seek(layout[col]["offset"])
                with open(self._spills[col], "rb") as spill:
                    shutil.copyfileobj(spill, out, 1 << 20)
            out.truncate(route_bin._align(out.tell()))
            route_bin.seal(out)

    def _cleanup(self) -> None:
        for f in self._files.values():
            if not f.closed:
                try:
                    f.close()           # flushes its buffer: on a full disk, ENOSPC again
                except OSError:
                    pass                # discarded anyway: the failure is already reported
        self._target.discard()          # the temp file and the spills (none after publish)
