"""The small records that cross the residency manager's boundary."""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np


class Phase(enum.IntEnum):
    """What a batch is doing. Carried by every access and prefetch, never guessed."""

    PREFILL = 0
    DECODE = 1
    MIXED = 2  # a batch holding both: admission as decode, no speculative prefetch

    @property
    def label(self) -> str:
        return self.name.lower()


@dataclass(frozen=True, slots=True, order=True)
class ExpertKey:
    """Identity of one routed expert. Phase and device are never part of it."""

    layer: int
    expert: int


@dataclass(frozen=True, slots=True)
class Ticket:
    """A transfer notice: ``key`` (``bytes``) is resident on ``device`` now (its ``victims``
    are gone); the transport moves its bytes, or calls ``manager.transfer_failed``. ``id``:
    the manager's, unique per manager."""

    id: int
    device: str
    key: ExpertKey
    bytes: int
    victims: tuple[ExpertKey, ...]
    phase: Phase
    prefetch: bool


class LayerAccess(NamedTuple):
    """What one ``access_layer`` call decided. Hand it back to ``release()`` when done.

    An immutable record (a NamedTuple rather than a frozen dataclass: it is built once per
    layer-step on the hot path, and a NamedTuple is ~4x cheaper to construct).
    """

    device: str
    layer: int
    phase: Phase
    hits: int
    misses: int                        # distinct missed keys of the call
    demand_miss_bytes: int             # bytes of those keys
    admitted: tuple[ExpertKey, ...]    # resident now (the transport moves their bytes)
    evicted: tuple[ExpertKey, ...]     # victims of this call's admissions
    transient: tuple[ExpertKey, ...]   # used once without residency
    transition_hits: int = 0           # decode hits on experts admitted during prefill
    lease_id: int = 0                  # 0: nothing held (lease=False)


@dataclass(frozen=True, slots=True)
class UpcomingStep:
    """The next layer-step of an offline trace, for the ``belady`` prefetch policy only."""

    layer: int
    experts: np.ndarray       # (m,) int expert ids in routing order
    access_index: np.ndarray  # (m,) int64 access index of each element


@dataclass(frozen=True)
class ReplayOutcome:
    """What ``replay`` reports beyond the counters: per row and per prefetch."""

    miss_kind: np.ndarray       # (n_rows,) int8: at the first row of each missed key 1
                                # admitted, 2 transient; 4 at the first use (a hit) of a
                                # prefetched key; 0 elsewhere
    prefetch_event: np.ndarray  # (n_rows,) int64: at rows of kind 4, the prefetch's index
                                # in prefetch_batch / prefetch_flat; -1 elsewhere
    prefetch_batch: np.ndarray  # (n_prefetches,) int64 the batch that issued it, issue order
    prefetch_flat: np.ndarray   # (n_prefetches,) int32 its key (layer * n_expert + expert)


@dataclass(frozen=True)
class PoolSpec:
    """Layers that share one capacity on a device (the device cache: one expert layout)."""

    layers: tuple[int, ...]
    capacity_bytes: int            # bytes the pool may hold (slots x slot bytes)


# prefetch affinity's sources: a token's first experts at a layer in routing order (the
# router's strongest; affinity.c's AF_SOURCES), what its pair table learns and plans from
AFFINITY_SOURCES = 4
# the decode tokens prefetch affinity's neighbour vote keeps (neighbours.h's NB_HISTORY): what
# a routing profile carries for it
NEIGHBOUR_HISTORY = 128
