"""Zero-copy, read-only numpy views of experts through a read-only mmap, and dequantization.

Usage::

    with ExpertView.open("model.gguf") as view:
        raw = view.expert_bytes(layer=0, expert=3)        # {tensor name: uint8 view}
        w = view.dequantize(layer=0, expert=3)            # {tensor name: float32 array}
"""
from __future__ import annotations

import mmap
import os
from dataclasses import dataclass

import numpy as np
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from gguf_tools.expert_index import ExpertIndex


@dataclass(frozen=True)
class ExpertWeights:
    """One projection of one expert, dequantized: float32, numpy order (rows, ne0)."""

    tensor: str
    values: np.ndarray   # (ne1, ne0) for weights, (ne0,) for biases, () for scales


class ExpertView:
    """Read-only views of a GGUF file's experts. Close it (or use ``with``) to unmap."""

    def __init__(self, index: ExpertIndex):
        self.index = index
        with open(index.facts.path, "rb") as f:   # read-only: never opened for writing
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        self._buf = np.frombuffer(self._map, dtype=np.uint8)   # (file_bytes,) read-only

    @classmethod
    def open(cls, path: str | os.PathLike[str]) -> ExpertView:
        """Index ``path`` and map it read-only."""
        return cls(ExpertIndex.open(path))

    def __enter__(self) -> ExpertView:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Unmap the file (views handed out earlier must not be used afterwards)."""
        if self._map is not None:
            self._buf = None
            try:
                self._map.close()
            except BufferError:   # a caller still holds a view: leave it to the GC
                pass
            self._map = None

    def expert_bytes(self, layer: int, expert: int) -> dict[str, np.ndarray]:
        """Tensor name -> read-only uint8 view of that expert's bytes (no copy)."""
        return {r.tensor: self._buf[r.offset:r.end] for r in self.index.ranges(layer, expert)}

    def dequantize(self, layer: int, expert: int) -> dict[str, ExpertWeights]:
        """Tensor name -> float32 values of that expert (a copy; for checks, not speed)."""
        out = {}
        for t in self.index.tensors(layer):
            raw = self._buf[t.offset + expert * t.expert_stride:
                            t.offset + (expert + 1) * t.expert_stride]
            qtype = GGMLQuantizationType[t.ggml_type]
            inner = t.shape[:-1]                      # ggml order without the expert axis
            if qtype in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
                values = dequantize(raw, qtype)
            else:
                rows = int(np.prod(inner[1:])) if len(inner) > 1 else 1
                values = dequantize(raw.reshape(rows, -1), qtype)
            values = np.asarray(values, dtype=np.float32).reshape(tuple(reversed(inner)))
            out[t.name] = ExpertWeights(t.name, values)
        return out
