"""RouteTrace: a routing trace held in memory as columns, plus the model facts replay needs.

One row per routed (token, layer, slot): the expert a token's router picked at one MoE layer.
Rows are in execution order (see ``tests/runtime/traces/data/README.md``): prefill routes a whole
chunk per layer (layers ascending, steps ascending inside a layer, slots ascending), decode
routes one step at a time (layers ascending, slots ascending).

Replay groups rows into *layer batches*, one ``access_layer`` call each (see ``batch_bounds``).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from runtime.errors import UserError

PHASE_PREFILL = 0
PHASE_DECODE = 1
PHASE_MIXED = 2

# Column name -> numpy dtype (little endian). ``residency`` and ``recorded_bytes`` describe the
# recording engine's own cache (the CSV's ``residency`` and ``expert_bytes`` columns); replay
# ignores them, conversions keep them.
COLUMNS: dict[str, str] = {
    "turn": "<i4",
    "phase": "<i1",
    "step": "<i4",
    "layer": "<i2",
    "slot": "<i2",
    "expert": "<i2",
    "weight": "<f4",
    "residency": "<i1",
    "recorded_bytes": "<u4",
}


@dataclass(frozen=True)
class TracePool:
    """One pool of the device a live run recorded with (runtime.residency.manager.PoolSpec):
    replay with these pools reproduces that run's decisions exactly."""

    layers: tuple[int, ...]
    capacity_bytes: int

    def to_json(self) -> dict:
        return {"layers": list(self.layers), "capacity_bytes": self.capacity_bytes}


@dataclass(frozen=True)
class TraceHeader:
    """Model facts a trace carries: enough to replay it without the model file."""

    model: str                      # path of the model the trace was recorded from
    arch: str                       # general.architecture, e.g. "qwen3moe"
    n_layer: int
    n_expert: int
    n_expert_used: int              # top-k
    expert_bytes: tuple[int, ...]   # (n_layer,) bytes of ONE expert of each layer; 0 = dense
    dense_bytes: tuple[int, ...]    # (n_layer,) bytes of the layer's other tensors
    pools: tuple[TracePool, ...] = ()   # the recording device's pools (empty: none recorded)

    def __post_init__(self) -> None:
        object.__setattr__(self, "expert_bytes", tuple(int(b) for b in self.expert_bytes))
        object.__setattr__(self, "dense_bytes", tuple(int(b) for b in self.dense_bytes))
        object.__setattr__(self, "pools", tuple(
            p if isinstance(p, TracePool) else TracePool(tuple(int(x) for x in p["layers"]),
                                                         int(p["capacity_bytes"]))
            for p in self.pools))
        moe = {i for i, b in enumerate(self.expert_bytes) if b > 0}
        if self.pools:
            layers = [x for p in self.pools for x in p.layers]
            if sorted(layers) != sorted(moe) or any(p.capacity_bytes < 0 for p in self.pools):
                raise ValueError("pools must hold every MoE layer once, with capacities >= 0")
        if self.n_layer <= 0 or self.n_expert <= 0 or self.n_expert_used <= 0:
            raise ValueError("n_layer, n_expert and n_expert_used must be positive")
        if self.n_layer > 32767 or self.n_expert > 32767:  # layer/expert columns are int16
            raise ValueError("n_layer and n_expert must be <= 32767")
        if self.n_expert_used > self.n_expert:
            raise ValueError("n_expert_used exceeds n_expert")
        if len(self.expert_bytes) != self.n_layer or len(self.dense_bytes) != self.n_layer:
            raise ValueError("expert_bytes and dense_bytes need one entry per layer")
        if min(self.expert_bytes) < 0 or min(self.dense_bytes) < 0:
            raise ValueError("byte counts must be >= 0")

    @property
    def total_expert_bytes(self) -> int:
        """Bytes of every routed expert of the model: sum over layers of expert_bytes * n_expert."""
        return sum(self.expert_bytes) * self.n_expert

    def to_json(self) -> dict:
        return {
            "model": self.model, "arch": self.arch, "n_layer": self.n_layer,
            "n_expert": self.n_expert, "n_expert_used": self.n_expert_used,
            "expert_bytes": list(self.expert_bytes), "dense_bytes": list(self.dense_bytes),
            **({"pools": [p.to_json() for p in self.pools]} if self.pools else {}),
        }

    @classmethod
    def from_json(cls, obj: dict) -> TraceHeader:
        return cls(
            model=str(obj["model"]), arch=str(obj["arch"]), n_layer=int(obj["n_layer"]),
            n_expert=int(obj["n_expert"]), n_expert_used=int(obj["n_expert_used"]),
            expert_bytes=tuple(obj["expert_bytes"]), dense_bytes=tuple(obj["dense_bytes"]),
            pools=tuple(obj.get("pools", ())),
        )


@dataclass(frozen=True, eq=False)
class RouteTrace:
    """A whole trace: header plus equal-length columns, one element per routed row."""

    header: TraceHeader
    turn: np.ndarray            # (n,) int32 conversation turn
    phase: np.ndarray           # (n,) int8  0 prefill, 1 decode, 2 mixed
    step: np.ndarray            # (n,) int32 context position of the routed token
    layer: np.ndarray           # (n,) int16
    slot: np.ndarray            # (n,) int16 rank by router weight, 0 = largest
    expert: np.ndarray          # (n,) int16 expert id
    weight: np.ndarray          # (n,) float32 router weight
    residency: np.ndarray       # (n,) int8  recording engine's cache state (ignored by replay)
    recorded_bytes: np.ndarray  # (n,) uint32 bytes the recording engine read (0 on its hits)
    source: str = field(default="<memory>")

    def __post_init__(self) -> None:
        n = len(self.turn)
        for name, dtype in COLUMNS.items():
            col = np.asarray(getattr(self, name))
            if col.dtype != np.dtype(dtype):
                col = col.astype(dtype)
            if col.shape != (n,):
                raise ValueError(f"column {name} has shape {col.shape}, expected ({n},)")
            object.__setattr__(self, name, col)

    def __len__(self) -> int:
        return len(self.turn)

    @classmethod
    def from_columns(cls, header: TraceHeader, *, source: str = "<memory>",
                     residency: np.ndarray | None = None,
                     recorded_bytes: np.ndarray | None = None, **cols: np.ndarray) -> RouteTrace:
        """Build from the routing columns; without recorder columns every row counts as a
        recorder miss of its layer's expert bytes (an engine without an expert cache)."""
        layer = np.asarray(cols["layer"], dtype=np.int64)
        if residency is None:
            residency = np.zeros(len(layer), dtype="<i1")
        if recorded_bytes is None:
            eb = np.asarray(header.expert_bytes, dtype=np.int64)
            recorded_bytes = eb[np.clip(layer, 0, header.n_layer - 1)] if len(layer) else \
                np.zeros(0, dtype=np.int64)
        return cls(header=header, source=source, residency=residency,
                   recorded_bytes=recorded_bytes, **cols)

    # -- checks -----------------------------------------------------------------------------

    def validate(self, where: Callable[[int], str]) -> None:
        """Raise ``UserError`` naming the first bad row (see ``check_rows``)."""
        check_rows(self.header, {name: getattr(self, name) for name in COLUMNS}, where,
                   source=self.source)

    def take(self, rows: np.ndarray, source: str | None = None) -> RouteTrace:
        """The trace of ``rows`` (indices or a bool mask, execution order kept)."""
        return RouteTrace(header=self.header, source=source or self.source,
                          **{name: getattr(self, name)[rows] for name in COLUMNS})

    # -- views replay uses ------------------------------------------------------------------

    def batch_bounds(self) -> np.ndarray:
        """Start offsets of the layer batches, plus ``len(self)`` at the end: (n_batches + 1,).

        A batch is a maximal run of rows with the same turn, phase and layer; decode rows also
        split at every step (one token per batch). So a prefill chunk forms one batch per layer,
        a decode step one batch per layer. (A single-layer model's consecutive prefill chunks
        cannot be told apart in the CSV and merge into one batch.)
        """
        n = len(self)
        if n == 0:
            return np.zeros(1, dtype=np.int64)
        change = (np.diff(self.turn) != 0) | (np.diff(self.phase) != 0) | \
                 (np.diff(self.layer) != 0)
        decode = self.phase[1:] == PHASE_DECODE
        change |= decode & (np.diff(self.step) != 0)
        starts = np.flatnonzero(change) + 1
        return np.concatenate(([0], starts, [n])).astype(np.int64)

    def keys(self) -> np.ndarray:
        """(n,) int64 flat expert key per row: ``layer * n_expert + expert``."""
        return self.layer.astype(np.int64) * self.header.n_expert + self.expert

    def row_bytes(self) -> np.ndarray:
        """(n,) int64 bytes one miss of each row's expert costs (its layer's expert bytes)."""
        return np.asarray(self.header.expert_bytes, dtype=np.int64)[self.layer]

    def token_count(self, phase: int) -> int:
        """Distinct (turn, step) tokens routed in ``phase``."""
        m = self.phase == phase
        if not m.any():
            return 0
        pairs = self.turn[m].astype(np.int64) << 32 | self.step[m].astype(np.int64)
        return int(len(np.unique(pairs)))


def check_rows(header: TraceHeader, cols: dict[str, np.ndarray], where: Callable[[int], str],
               *, source: str) -> None:
    """Raise ``UserError`` naming the first bad row of ``cols`` (checked before any narrowing
    cast); ``where(i)`` renders row i's location, e.g. ``"trace.csv: line 57"``."""
    h = header
    if len(cols["layer"]) == 0:
        raise UserError(f"{source}: no routing rows")
    checks = (
        ("layer", 0, h.n_layer - 1, f"model has {h.n_layer} layers"),
        ("expert", 0, h.n_expert - 1, f"model has {h.n_expert} experts"),
        ("slot", 0, h.n_expert_used - 1, f"n_expert_used={h.n_expert_used}"),
        ("phase", 0, 2, "0 prefill, 1 decode, 2 mixed"),
        ("step", 0, np.iinfo(np.int32).max, "must be >= 0"),
        ("turn", 0, np.iinfo(np.int32).max, "must be >= 0"),
        ("residency", 0, 2, "0 miss, 1 hit, 2 prefetched hit"),
        ("recorded_bytes", 0, np.iinfo(np.uint32).max, "0 .. 2**32-1"),
    )
    for name, lo, hi, why in checks:
        col = cols[name]
        bad = np.flatnonzero((col < lo) | (col > hi))
        if len(bad):
            i = int(bad[0])
            raise UserError(f"{where(i)}: {name}={int(col[i])} out of range ({why})")
    dense = np.asarray(h.expert_bytes, dtype=np.int64)[cols["layer"]] == 0
    if dense.any():
        i = int(np.flatnonzero(dense)[0])
        raise UserError(f"{where(i)}: layer {int(cols['layer'][i])} has no routed experts "
                        f"(expert_bytes=0 in the header)")
    weight = cols["weight"]
    if not np.isfinite(weight).all():
        i = int(np.flatnonzero(~np.isfinite(weight))[0])
        raise UserError(f"{where(i)}: weight is not a finite number")
