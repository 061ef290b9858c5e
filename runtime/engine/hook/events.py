"""The routing hook's records: what a layer's routing is (``RouteEvent``), who receives it
(``RouteObserver``) and how a failure inside the graph is reported (``RouteCaptureError``).
Both hooks (the C one, c_hook.py, and its reference, reference.py) hand these out.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np

from runtime.residency.types import Phase


@dataclass(frozen=True, slots=True)
class RouteEvent:
    """The routing of one layer for one ubatch: every row is one token."""

    layer: int
    phase: Phase
    first_step: int          # context position of the first token (row 0)
    turn: int
    experts: np.ndarray      # (n_tokens, n_expert_used) int32, slot order (weight descending)
    weights: np.ndarray      # (n_tokens, n_expert_used) float32, the weights applied

    @property
    def n_tokens(self) -> int:
        return int(self.experts.shape[0])


class RouteObserver(Protocol):
    def on_route(self, event: RouteEvent) -> None:
        """Called synchronously between a layer's router and its expert matmuls."""

    def on_batch_end(self, phase: Phase, n_tokens: int) -> None:
        """Called after each ``llama_decode`` (also a failed one, before its error is raised,
        so leases get released); n_tokens: the batch's tokens."""


class RouteCaptureError(RuntimeError):
    """Routing capture or an observer failed during a decode; its results are discarded."""


def raise_failure(error: BaseException) -> None:
    """Raise what an observer (or the capture) raised inside the graph: KeyboardInterrupt,
    SystemExit and RouteCaptureError as they are, anything else as RouteCaptureError."""
    if isinstance(error, (KeyboardInterrupt, SystemExit, RouteCaptureError)):
        raise error
    raise RouteCaptureError(f"routing observer failed: {error!r}") from error
