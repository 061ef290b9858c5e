"""Where every routed expert lives in a GGUF file: absolute byte ranges per (layer, expert).

Usage::

    index = ExpertIndex.open("model.gguf")
    for r in index.ranges(layer=3, expert=17):     # gate, up, down (+ bias/scale) slices
        os.pread(fd, r.length, r.offset)
"""
from __future__ import annotations

import os
from dataclasses import dataclass

from gguf import GGUFReader

from gguf_tools.facts import ExpertTensor, ModelFacts, open_gguf, scan_model


@dataclass(frozen=True, slots=True)
class ByteRange:
    """``length`` bytes of tensor ``tensor`` starting at absolute file ``offset``."""

    tensor: str
    offset: int   # bytes from the start of the file
    length: int   # bytes

    @property
    def end(self) -> int:
        return self.offset + self.length


class ExpertIndex:
    """Byte ranges of every expert of every MoE layer (immutable after construction)."""

    def __init__(self, facts: ModelFacts, tensors: tuple[ExpertTensor, ...]):
        self.facts = facts
        by_layer: dict[int, list[ExpertTensor]] = {}
        for t in tensors:
            by_layer.setdefault(t.layer, []).append(t)
        # per layer, tensors in file order (offset ascending)
        self._layers: dict[int, tuple[ExpertTensor, ...]] = {
            layer: tuple(sorted(ts, key=lambda t: t.offset)) for layer, ts in by_layer.items()}

    @classmethod
    def open(cls, path: str | os.PathLike[str]) -> ExpertIndex:
        """Index the MoE GGUF at ``path`` (read-only); ``UserError`` on bad input."""
        return cls.from_reader(open_gguf(path), path)

    @classmethod
    def from_reader(cls, reader: GGUFReader, path: str | os.PathLike[str]) -> ExpertIndex:
        """Index an already opened ``GGUFReader`` of the file at ``path``."""
        facts, tensors = scan_model(reader, path)
        return cls(facts, tensors)

    def tensors(self, layer: int) -> tuple[ExpertTensor, ...]:
        """The routed-expert tensors of ``layer`` in file order (empty for a dense layer)."""
        return self._layers.get(layer, ())

    def ranges(self, layer: int, expert: int) -> tuple[ByteRange, ...]:
        """Every projection's bytes of one expert (weights, biases, scales), in file order."""
        if layer not in self._layers:
            raise KeyError(f"layer {layer} has no routed experts (MoE layers: "
                           f"{list(self.facts.moe_layers)})")
        if not 0 <= expert < self.facts.n_expert:
            raise IndexError(f"expert {expert} out of range 0..{self.facts.n_expert - 1}")
        return tuple(ByteRange(t.name, t.offset + expert * t.expert_stride, t.expert_stride)
                     for t in self._layers[layer])

    def expert_bytes(self, layer: int) -> int:
        """Bytes of one expert of ``layer`` (0 for a dense layer)."""
        return self.facts.expert_bytes[layer]
