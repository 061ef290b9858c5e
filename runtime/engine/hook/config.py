"""The live routing hook's own description: what ``rh_create`` and ``rh_begin_batch`` are
told, built by the engine from the model's facts (the C hook needs nothing of its slow
reference, reference.RouteAssembler; the reference is built from the same description)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class HookConfig:
    """One model's routing, as the hook reads it."""

    n_layer: int                  # the model's layers (the hook's per-layer tables)
    moe_layers: tuple[int, ...]   # the layers whose routing is read (whole remote layers left
    #                               out: reading them would cost a round trip each)
    n_expert_used: int            # k: experts per token, the columns of an event's rows
    strict: bool = False          # check every token of every MoE layer was routed (recording)

    def __post_init__(self) -> None:
        bad = [layer for layer in self.moe_layers if not 0 <= layer < self.n_layer]
        if bad:
            raise ValueError(f"MoE layers {bad} outside the model's {self.n_layer} layers")
