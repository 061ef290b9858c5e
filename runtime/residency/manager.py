"""ExpertResidencyManager: the one authority for where every expert lives.

Usage (simulated: no device, no llama.cpp; the live runtime runs the same code)::

    import numpy as np
    from runtime.residency.manager import ExpertResidencyManager
    from runtime.residency.types import ExpertKey, Phase

    m = ExpertResidencyManager.create_simulated(
        expert_bytes=[3 << 20] * 48, n_expert=128, capacity_bytes=2 << 30, policy="lru")
    access = m.access_layer("sim", 0, np.array([5, 17, 3, 90]), Phase.DECODE)
    ...                                  # run the layer's experts; they are leased meanwhile
    m.release(access)
    print(access.hits, access.misses, access.demand_miss_bytes)
    print(m.snapshot().to_prometheus())

Live: ``m = ExpertResidencyManager(load_config(path), transport=...)``, then
``m.bind_model(facts.expert_bytes, facts.n_expert)`` and ``m.resolve_devices()``; each
``access_layer`` returns tickets to wait on (``m.wait(access.tickets)``) before the matmul.

The manager owns slots, bytes, leases and counters (``DeviceState``); policies only score and
decide (``policies/``). One lock guards the state; it is never held while bytes move: tickets
are handed to the transport after the lock is released.
"""
from __future__ import annotations

import threading
from typing import Callable, Sequence

import numpy as np

from runtime.errors import UserError
from runtime.residency.capacity import probe_device_memory, resolve_budget
from runtime.residency.config import ResidencyConfig, preset_config
from runtime.residency.access_path import AccessPathMixin
from runtime.residency.general_path import GeneralPathMixin
from runtime.residency.device_state import RESIDENT_MAX, DeviceState
from runtime.residency.native_step import load_lru_step
from runtime.residency.policies import factory
from runtime.residency.policies.prefetch import NoPrefetch
from runtime.residency.static import StaticMixin
from runtime.residency.stats import UsageStats
from runtime.residency.telemetry import DeviceSnapshot, ResidencySnapshot
from runtime.residency.transfers import TransfersMixin
from runtime.residency.transport import SimulatedTransport, Transport
from runtime.residency.types import ExpertKey, LayerAccess, Phase



class ExpertResidencyManager(AccessPathMixin, GeneralPathMixin, TransfersMixin, StaticMixin):
    """Decides, records and counts expert residency on every device. Thread-safe."""

    def __init__(self, config: ResidencyConfig | None = None, *,
                 transport: Transport | None = None):
        self.config = config if config is not None else ResidencyConfig()
        self._transport = transport if transport is not None else SimulatedTransport()
        self._inline = bool(getattr(self._transport, "inline", False))
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        phases = [self.config.policies_for(p) for p in Phase]
        specs: list = []
        for pp in phases:
            if pp.eviction not in specs:
                specs.append(pp.eviction)
        self._eviction_specs = specs
        self._phase_evictor = tuple(specs.index(pp.eviction) for pp in phases)
        self._admission = [factory.build_admission(pp.admission) for pp in phases]
        self._prefetch = [factory.build_prefetch(pp.prefetch) for pp in phases]
        self._prefetch[Phase.MIXED] = NoPrefetch()  # MIXED: no speculative prefetch
        self._devices: dict[str, DeviceState] = {}
        self._n_expert = 0
        self._expert_bytes: np.ndarray | None = None
        self._moe_layer: list[bool] = []
        self._n_layer = 0
        self._layer_base: list[int] = []
        # MoE layer -> (flat key of its expert 0, {expert id: flat key}, bytes of one expert)
        self._layer_flat: dict[int, tuple[int, dict[int, int], int]] = {}
        self._next_layers: list[tuple[int, ...]] = []
        self._seq = 0            # access sequence number: one per routed element
        self._next_lease = 1
        self._next_ticket = 1
        # leases live per device (DeviceState.leases): a lease only protects its own device
        self._drop_noop = isinstance(self._transport, SimulatedTransport)
        self._fast_enabled = True   # tests turn the one-pass lru path off to compare paths
        self._lru_step = load_lru_step()   # C, or its Python reference (tests pick one)
        self._transport.bind(self)

    # ---- setup ---------------------------------------------------------------------------
    @classmethod
    def create_simulated(cls, *, expert_bytes: Sequence[int], n_expert: int, capacity_bytes: int,
                         config: ResidencyConfig | None = None, policy: str | None = None,
                         device: str = "sim") -> ExpertResidencyManager:
        """A manager over one simulated device with a fixed capacity (no GPU, no llama.cpp).

        ``policy`` is a preset name (``preset_config``), exclusive with ``config``.
        """
        if config is not None and policy is not None:
            raise ValueError("give config or policy, not both")
        if policy is not None:
            config = preset_config(policy)
        manager = cls(config)
        manager.bind_model(expert_bytes, n_expert)
        manager.reconfigure(device, capacity_bytes)
        return manager

    def bind_model(self, expert_bytes: Sequence[int], n_expert: int) -> None:
        """Learn the model's shape: bytes of one expert per layer (0: dense), experts per layer."""
        eb = np.asarray(expert_bytes, dtype=np.int64)
        if eb.ndim != 1 or len(eb) == 0 or (eb < 0).any() or n_expert <= 0:
            raise UserError("bind_model: need per-layer expert bytes (>= 0) and n_expert > 0")
        with self._lock:
            if self._expert_bytes is not None:
                raise UserError("bind_model: a model is already bound to this manager")
            self._expert_bytes = eb
            self._n_expert = int(n_expert)
            self._moe_layer = (eb > 0).tolist()
            self._n_layer = len(eb)
            # flat key of (layer, expert 0); -1 for dense layers
            self._layer_base = [i * int(n_expert) if b else -1
                                for i, b in enumerate(self._moe_layer)]
            self._layer_flat = {i: (base, {e: base + e for e in range(n_expert)}, int(eb[i]))
                                for i, base in enumerate(self._layer_base) if base >= 0}
            moe = [i for i, b in enumerate(self._moe_layer) if b]
            self._next_layers = [tuple(x for x in moe if x > i) for i in range(len(eb))]
            for budget in self.config.devices:
                self._add_device(budget.device)

    def _add_device(self, name: str) -> DeviceState:
        evictors = [factory.build_eviction(s) for s in self._eviction_specs]
        rates = {e.decay_rate for e in evictors if e.decay_rate > 0}
        if len(rates) > 1:
            raise UserError(f"{self.config.source}: lfu-decay half_life must be the same in "
                            "every phase")
        roles = [*self._admission, *self._prefetch]
        stats = UsageStats(
            len(self._expert_bytes), self._n_expert,
            track_uses=any(getattr(p, "needs_uses", False) for p in [*evictors, *roles]),
            decay_rate=rates.pop() if rates else 0.0,
            track_next_use=any(getattr(p, "needs_next_use", False) for p in [*evictors, *roles]),
            track_history=any(getattr(p, "needs_history", False) for p in self._prefetch))
        st = DeviceState(name, self._expert_bytes, self._n_expert, evictors, self._phase_evictor,
                         stats)
        # lean: the per-access loop only records the access order (lru, or monotone scores
        # that need nothing else); anything else takes the general loop
        # fast[phase]: that phase may take the one-pass lru path (lru alone, admit always, no
        # prefetch, inline transport, capacity set); access_layer also checks that nothing
        # is leased, pinned or in flight
        st.lean = (len(st.recency) <= 1 and not st.touch_each and stats.uses is None
                   and stats.decay_log is None and stats.next_use is None
                   and (len(st.recency) == 0 or len(st.orders) == 1))
        st.fast_policy = [bool(st.lean and st.recency and self._admission[p].trivial
                               and self._prefetch[p].name == "none") for p in range(3)]
        self._refresh_fast(st)
        self._devices[name] = st
        return st

    def set_transport(self, transport: Transport) -> None:
        """Replace the transport: a tier (runtime.ramtier) attaching after the engine built
        the manager. Only while nothing is leased or in flight (RuntimeError otherwise)."""
        with self._lock:
            if any(st.leases or st.tickets for st in self._devices.values()):
                raise RuntimeError("set_transport: the manager has leases or tickets in flight")
            self._transport = transport
            self._inline = bool(getattr(transport, "inline", False))
            self._drop_noop = isinstance(transport, SimulatedTransport)
            for st in self._devices.values():
                self._refresh_fast(st)
        transport.bind(self)

    @property
    def transport(self) -> Transport:
        return self._transport

    def _refresh_fast(self, st: DeviceState) -> None:
        ok = (self._inline and self._fast_enabled and st.capacity is not None
              and not st.static)
        st.fast = [ok and p for p in st.fast_policy]

    @property
    def _fast(self) -> bool:
        return self._fast_enabled

    @_fast.setter
    def _fast(self, enabled: bool) -> None:
        self._fast_enabled = enabled
        for st in self._devices.values():
            self._refresh_fast(st)

    def resolve_device(self, device: str, *, free_bytes: int | None,
                       total_bytes: int | None) -> int:
        """Turn the device's configured budget into bytes and apply it; returns the capacity."""
        if self._expert_bytes is None:
            raise UserError(f"{device}: capacity is resolved after bind_model()")
        capacity = resolve_budget(self.config.budget(device), free_bytes=free_bytes,
                                  total_bytes=total_bytes,
                                  largest_expert=int(self._expert_bytes.max()),
                                  source=self.config.source)
        self.reconfigure(device, capacity)
        return capacity

    def resolve_devices(self, probe: Callable[[str], tuple[int, int] | None] = probe_device_memory
                        ) -> dict[str, int]:
        """Resolve every configured device with ``probe(device) -> (free, total) | None``."""
        out = {}
        for budget in self.config.devices:
            mem = probe(budget.device)
            free, total = mem if mem is not None else (None, None)
            out[budget.device] = self.resolve_device(budget.device, free_bytes=free,
                                                     total_bytes=total)
        return out

    def reconfigure(self, device: str, capacity_bytes: int) -> None:
        """Set a device's capacity atomically. Refused (UserError) below the bytes charged
        (resident + in flight) or while tickets are pending on it."""
        with self._lock:
            if self._expert_bytes is None:
                raise UserError(f"{device}: reconfigure needs a bound model (bind_model)")
            st = self._devices.get(device) or self._add_device(device)
            if capacity_bytes <= 0:
                raise UserError(f"{device}: capacity must be positive, got {capacity_bytes}")
            if st.tickets:
                raise UserError(f"{device}: cannot reconfigure while {len(st.tickets)} "
                                "transfer(s) are pending")
            charged = st.resident_bytes + st.pending_bytes
            if capacity_bytes < charged:
                raise UserError(f"{device}: capacity {capacity_bytes} bytes is below the "
                                f"{charged} bytes currently charged")
            st.capacity = int(capacity_bytes)
            st.reason = ""
            self._refresh_fast(st)

    def _unknown_device(self, device: str):
        if self._expert_bytes is None:
            raise UserError("residency manager: no model bound yet (call bind_model first)")
        raise UserError(f"unknown device {device!r} (known: {', '.join(self._devices) or 'none'})")

    def release(self, access: LayerAccess) -> None:
        """End the leases of an access. Idempotent.

        Lock-free: one dict.pop is atomic under the GIL, and readers iterate a copy.
        """
        st = self._devices.get(access.device)
        if st is not None:
            st.leases.pop(access.lease_id, None)

    # ---- queries -------------------------------------------------------------------------
    def is_resident(self, device: str, key: ExpertKey) -> bool:
        st = self._devices[device]
        return st.state[key.layer * self._n_expert + key.expert] <= RESIDENT_MAX

    def resident_mask(self, device: str, layer: int) -> np.ndarray:
        """(n_expert,) bool: which experts of ``layer`` are resident on ``device`` (a copy)."""
        with self._lock:
            return self._devices[device].state_np[layer] <= RESIDENT_MAX

    def capacity(self, device: str) -> int | None:
        st = self._devices.get(device)
        return None if st is None else st.capacity

    def unresolved_reason(self, device: str) -> str | None:
        """Why nothing is admitted on ``device`` (None once its capacity is set)."""
        if self._expert_bytes is None:
            return "no model bound yet (bind_model)"
        st = self._devices.get(device)
        if st is None:
            return f"unknown device {device!r}"
        return st.reason or None

    @property
    def devices(self) -> tuple[str, ...]:
        return tuple(self._devices)

    def verify(self) -> None:
        """Assert every bookkeeping invariant (tests and debugging; O(experts))."""
        with self._lock:
            for st in self._devices.values():
                st.verify()

    def snapshot(self) -> ResidencySnapshot:
        """Counters and occupancy of every device, frozen."""
        with self._lock:
            return ResidencySnapshot(tuple(
                DeviceSnapshot(st.name, st.capacity, st.resident_bytes, st.resident_count,
                               len(st.tickets), st.pending_bytes,
                               tuple(t.freeze() for t in st.tally), st.reason,
                               st.static_bytes if st.static else None)
                for st in self._devices.values()))
