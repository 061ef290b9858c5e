"""Per-device usage statistics the manager keeps and policies read (never write).

Keys are flat ints ``flat = layer * n_expert + expert``. The per-key arrays are Python
``array``s, fast to index one element at a time from the manager's per-access loop, with numpy
views over the same memory for vector reads (``*_np``).
"""
from __future__ import annotations

from array import array

import numpy as np

NEVER = 2**62  # next_use value meaning "not used again"


class UsageStats:
    """What policies may look at for one device. The manager updates it on every access."""

    __slots__ = ("n_layer", "n_expert", "n_flat", "last_seq", "uses", "decay_log", "decay_rate",
                 "next_use", "last_experts", "last_seq_np", "uses_np")

    def __init__(self, n_layer: int, n_expert: int, *, track_uses: bool, decay_rate: float,
                 track_next_use: bool, track_history: bool):
        n_flat = n_layer * n_expert
        self.n_layer = n_layer
        self.n_expert = n_expert
        self.n_flat = n_flat
        self.last_seq = array("q", [-1]) * n_flat              # access sequence number
        self.last_seq_np = np.frombuffer(self.last_seq, dtype=np.int64)
        # routed count per Phase: uses[phase * n_flat + flat]; None when no policy reads it
        self.uses = array("q", [0]) * (3 * n_flat) if track_uses else None
        self.uses_np = (None if self.uses is None
                        else np.frombuffer(self.uses, dtype=np.int64).reshape(3, n_flat))
        # lfu-decay: log of sum over accesses of exp(rate * seq), an order-preserving form of
        # the exponentially decayed count that only grows with every access
        self.decay_rate = decay_rate
        self.decay_log = array("d", [float("-inf")]) * n_flat if decay_rate > 0 else None
        self.next_use = array("q", [NEVER]) * n_flat if track_next_use else None
        # experts routed by the last access of each (phase, layer), for chunk-plan prefetch
        self.last_experts: list[dict[int, np.ndarray]] | None = (
            [{}, {}, {}] if track_history else None)

    def uses_of(self, flat: int) -> int:
        """Routed count of one key over every phase (0 when uses are not tracked)."""
        u = self.uses
        if u is None:
            return 0
        n = self.n_flat
        return u[flat] + u[n + flat] + u[2 * n + flat]
