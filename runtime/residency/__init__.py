"""Expert residency: one manager decides where every expert lives (GPU, host RAM, storage)."""
from __future__ import annotations

from runtime.residency.types import ExpertKey, LayerAccess, Phase, Ticket, UpcomingStep

__all__ = ["ExpertKey", "LayerAccess", "Phase", "Ticket", "UpcomingStep"]
