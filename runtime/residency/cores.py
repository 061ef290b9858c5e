"""The residency core a device runs: the C core (core/c_core.py) or its slow Python reference
(reference/core.py), chosen by name. Apart from core/ so that the reference, which reads the core's
constants, does not import back into it."""
from __future__ import annotations

from runtime.residency.core import CorePolicy
from runtime.residency.core.c_core import CCore
from runtime.residency.reference.core import ReferenceCore


def make_core(kind: str, n_layer: int, n_expert: int, expert_bytes, policy: CorePolicy):
    """A DeviceCore: ``kind`` "native" (the C core) or "reference" (the Python one)."""
    if kind == "native":
        return CCore(n_layer, n_expert, expert_bytes, policy)
    if kind == "reference":
        return ReferenceCore(n_layer, n_expert, expert_bytes, policy)
    raise ValueError(f"unknown residency core {kind!r} (valid: native, reference)")
