"""Admission policies: given a demand miss, admit it (evicting) or use it transiently."""
from __future__ import annotations

from dataclasses import dataclass

from runtime.residency.types import Phase


@dataclass(frozen=True, slots=True)
class AdmissionQuery:
    """Everything an admission policy may look at for one miss."""

    phase: Phase
    key_uses: int                 # routed count of the key on this device, this access included
    need_bytes: int               # bytes of the missed expert
    free_bytes: int               # capacity - resident - pending
    now_seq: int                  # access sequence number of this access
    victim_seq: int | None        # last access seq of the first victim; None: no eviction needed
    next_use: int | None          # offline: access index of the key's next use
    victim_next_use: int | None   # offline: next use of the first victim


class AlwaysAdmit:
    """Demand admission: every miss is admitted when a victim set exists."""

    name = "always"
    trivial = True  # the manager skips building a query
    needs_uses = False
    needs_next_use = False

    def admit(self, q: AdmissionQuery) -> bool:
        return True


class ReuseThreshold:
    """Admit a decode miss only when its expected reuse pays for the transfer.

    ``break_even`` = transfer cost / compute-in-place cost. The expected reuse of a key is
    estimated by how often it has been routed on this device so far. Prefill misses are
    always admitted (a chunk uses an expert for many tokens).
    """

    name = "reuse-threshold"
    trivial = False
    needs_uses = True
    needs_next_use = False

    def __init__(self, break_even: float = 2.0):
        self.break_even = break_even

    def admit(self, q: AdmissionQuery) -> bool:
        if q.phase == Phase.PREFILL:
            return True
        return q.key_uses >= self.break_even


class TransientOnPressure:
    """Admit unless it would evict an expert used within the last ``window`` accesses."""

    name = "transient-on-pressure"
    trivial = False
    needs_uses = False
    needs_next_use = False

    def __init__(self, window: float = 4096.0):
        self.window = window

    def admit(self, q: AdmissionQuery) -> bool:
        if q.victim_seq is None:
            return True
        return q.now_seq - q.victim_seq > self.window


class BeladyBypass:
    """Offline: decline a miss whose next use lies beyond every evictable resident's."""

    name = "belady-bypass"
    trivial = False
    needs_uses = False
    needs_next_use = True

    def admit(self, q: AdmissionQuery) -> bool:
        if q.victim_next_use is None:
            return True
        return q.next_use is not None and q.next_use < q.victim_next_use
