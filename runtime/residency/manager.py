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
``m.bind_model(facts.expert_bytes, facts.n_expert)`` and ``m.resolve_devices()``.

The manager is a lock and the transport over one residency core per device
(runtime/residency/core: the C core; tests may pick its Python reference). The core owns
every per-access decision, the state behind it and the lease ids (``step`` is its step,
rc_step, for a consumer that holds one lease at a time); the manager turns its flat keys into
``ExpertKey``s, hands transfers to the transport after the lock is released, and reports.
Each device is split into pools (layers that share a capacity; one pool unless the native
cache reports several layouts): admission, eviction and counters are per pool.

A decision takes effect at once (replay and the live runtime decide alike); the transport is
then told what to drop and move (``TransferNotices``, runtime/residency/transport.py), and a
failed move calls ``transfer_failed``: the expert leaves the device.
"""
from __future__ import annotations

import threading
from dataclasses import replace
from typing import Callable, Sequence

import numpy as np

from runtime.errors import UserError
from runtime.residency import core as core_api
from runtime.residency import static as static_plan
from runtime.residency.capacity import probe_device_memory, resolve_budget
from runtime.residency.config import ResidencyConfig, preset_config
from runtime.residency.core import RESIDENT_MAX, CoreError, CorePolicy
from runtime.residency.cores import make_core
from runtime.residency.device import (Device, expert_map, pool_of_layer, refusal,
                                      replay_problem)
from runtime.residency.telemetry import ResidencySnapshot
from runtime.residency.transport import (SimulatedTransport, TransferNotices, Transport,
                                         simulated)
from runtime.residency.types import (ExpertKey, LayerAccess, Phase, PoolSpec, ReplayOutcome,
                                     Ticket)

_EMPTY: tuple = ()
_NONE: list = []           # no notices, no drops (never appended to)
_new_tuple = tuple.__new__   # builds a LayerAccess without its Python-level __new__


class ExpertResidencyManager:
    """Decides, records and counts expert residency on every device. Thread-safe."""

    def __init__(self, config: ResidencyConfig | None = None, *,
                 transport: Transport | None = None, core: str = "native"):
        """``core``: "native" (the C core) or "reference" (its Python reference: tests)."""
        self.config = config if config is not None else ResidencyConfig()
        self.policy = CorePolicy.from_config(self.config)
        self._core_kind = core
        self._transport = transport if transport is not None else SimulatedTransport()
        self._lock = threading.Lock()
        self._devices: dict[str, Device] = {}
        self._n_expert = 0
        self._expert_bytes: np.ndarray | None = None
        self._moe_layers: tuple[int, ...] = ()
        self._key_list: list[ExpertKey] | None = None   # ExpertKey per flat key (lazy)
        self._notices = TransferNotices()   # what a real transport is told (Ticket ids)
        self._transport.bind(self)

    # ---- setup ---------------------------------------------------------------------------
    @classmethod
    def create_simulated(cls, *, expert_bytes: Sequence[int], n_expert: int, capacity_bytes: int,
                         config: ResidencyConfig | None = None, policy: str | None = None,
                         device: str = "sim", core: str = "native",
                         n_expert_used: int = 0) -> ExpertResidencyManager:
        """A manager over one simulated device with a fixed capacity (no GPU, no llama.cpp).

        ``policy`` is a preset name (``preset_config``), exclusive with ``config``;
        ``n_expert_used``: see ``bind_model``.
        """
        if config is not None and policy is not None:
            raise ValueError("give config or policy, not both")
        if policy is not None:
            config = preset_config(policy)
        manager = cls(config, core=core)
        manager.bind_model(expert_bytes, n_expert, n_expert_used)
        manager.reconfigure(device, capacity_bytes)
        return manager

    def bind_model(self, expert_bytes: Sequence[int], n_expert: int,
                   n_expert_used: int = 0) -> None:
        """Learn the model's shape: bytes of one expert per layer (0: dense), experts per layer,
        experts routed per token (0 unknown: prefetch affinity then learns from decode only,
        not from the prompt's token-major chunks)."""
        eb = np.asarray(expert_bytes, dtype=np.int64)
        if eb.ndim != 1 or len(eb) == 0 or (eb < 0).any() or n_expert <= 0 \
                or n_expert_used < 0:
            raise UserError("bind_model: need per-layer expert bytes (>= 0), n_expert > 0 and "
                            "n_expert_used >= 0")
        if not (eb > 0).any():
            raise UserError("bind_model: the model has no layer with routed experts")
        with self._lock:
            if self._expert_bytes is not None:
                raise UserError("bind_model: a model is already bound to this manager")
            self._expert_bytes = eb
            self._n_expert = int(n_expert)
            self.policy = replace(self.policy, n_expert_used=int(n_expert_used))
            self._moe_layers = tuple(i for i, b in enumerate(eb.tolist()) if b > 0)
            for budget in self.config.devices:
                self._add_device(budget.device)

    @property
    def _keys(self) -> list[ExpertKey]:
        """ExpertKey of every flat key (built on first use: replay never needs them)."""
        if self._key_list is None:
            ne = self._n_expert
            self._key_list = [ExpertKey(layer, e) for layer in range(len(self._expert_bytes))
                              for e in range(ne)]
        return self._key_list

    def _add_device(self, name: str) -> Device:
        core = make_core(self._core_kind, len(self._expert_bytes), self._n_expert,
                         self._expert_bytes.tolist(), self.policy)
        dev = Device(name, core, self._moe_layers, simulated(self._transport, name))
        self._devices[name] = dev
        return dev

    def set_transport(self, transport: Transport) -> None:
        """Replace the transport: a tier (runtime.ramtier, runtime.native) attaching after the
        engine built the manager. Only while nothing is leased (RuntimeError)."""
        with self._lock:
            if any(d.core.n_leases for d in self._devices.values()):
                raise RuntimeError("set_transport: the manager has leases held")
            self._transport = transport
            self._refresh_locked()
        transport.bind(self)

    def refresh_transport(self) -> None:
        """Re-read which transport serves each device (a mux gained a device)."""
        with self._lock:
            self._refresh_locked()

    def _refresh_locked(self) -> None:
        for dev in self._devices.values():
            dev.sim = simulated(self._transport, dev.name)

    @property
    def transport(self) -> Transport:
        return self._transport

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
        """Set a one-pool device's capacity atomically. Refused (UserError) below its resident
        bytes, or on a device split into pools (``set_pools`` sets those)."""
        with self._lock:
            if self._expert_bytes is None:
                raise UserError(f"{device}: reconfigure needs a bound model (bind_model)")
            dev = self._devices.get(device) or self._add_device(device)
            if capacity_bytes <= 0:
                raise UserError(f"{device}: capacity must be positive, got {capacity_bytes}")
            if len(dev.pools) > 1:
                raise UserError(f"{device}: the device has {len(dev.pools)} pools; its "
                                "capacity is set per pool (set_pools)")
            self._set_capacity(dev, 0, int(capacity_bytes))
            dev.reason = ""

    def _set_capacity(self, dev: Device, pool: int, capacity: int) -> None:
        rc = dev.core.set_capacity(pool, capacity)
        if rc == core_api.ERR_CHARGED:
            raise UserError(f"{dev.name}: capacity {capacity} bytes is below the "
                            f"{dev.core.pool_stats(pool).resident_bytes} bytes resident")
        if rc != 0:
            raise UserError(f"{dev.name}: cannot set capacity (status {rc})")

    def set_pools(self, device: str, pools: Sequence[PoolSpec]) -> None:
        """Split ``device`` into pools (every MoE layer in exactly one), each with its own
        capacity. Only while the device holds nothing (no resident expert or lease)."""
        with self._lock:
            if self._expert_bytes is None:
                raise UserError(f"{device}: set_pools needs a bound model (bind_model)")
            dev = self._devices.get(device) or self._add_device(device)
            of_layer = pool_of_layer(device, pools, len(self._expert_bytes), self._moe_layers)
            rc = dev.core.set_pools(of_layer, [p.capacity_bytes for p in pools])
            if rc == core_api.ERR_STATE:
                raise UserError(f"{device}: pools change only while the device holds nothing")
            if rc != 0:
                raise UserError(f"{device}: cannot set pools (status {rc})")
            dev.pools = tuple(tuple(sorted(p.layers)) for p in pools)
            dev.reason = ""

    def pools(self, device: str) -> tuple[PoolSpec, ...]:
        """The device's pools and their capacities (-1: unresolved)."""
        with self._lock:
            dev = self._device(device)
            return tuple(PoolSpec(layers, dev.core.pool_stats(i).capacity)
                         for i, layers in enumerate(dev.pools))

    def _device(self, device: str) -> Device:
        dev = self._devices.get(device)
        if dev is None:
            self._unknown_device(device)
        return dev

    def _unknown_device(self, device: str):
        if self._expert_bytes is None:
            raise UserError("residency manager: no model bound yet (call bind_model first)")
        raise UserError(f"unknown device {device!r} (known: {', '.join(self._devices) or 'none'})")

    # ---- the hot path --------------------------------------------------------------------
    def access_layer(self, device: str, layer: int, experts, phase: Phase, *,
                     next_use=None, upcoming=None, lease: bool = True,
                     release: LayerAccess | None = None) -> LayerAccess:
        """Record one layer-step's routed experts; see contracts.md ("Residency").

        experts: (n_tokens * k,) int expert ids in routing order, each in [0, n_expert).
        next_use: same shape, the access index of each element's next use (offline policies
        only); upcoming: the next layer-step (``UpcomingStep``, prefetch belady only). With
        ``lease`` the experts stay leased until ``release(access)``; ``lease=False`` holds them
        only during this call (replay). ``release``: an earlier access whose leases end first,
        exactly ``release(that)`` followed by this call.
        """
        dev = self._devices.get(device)
        if dev is None:
            self._unknown_device(device)
        up = None if upcoming is None else (upcoming.layer, upcoming.experts,
                                            upcoming.access_index)
        with self._lock:
            release_id = 0
            if release is not None:
                if release.device == device:
                    release_id = release.lease_id
                else:
                    self._release_locked(release)
            lease_id = dev.core.lease_id() if lease else 0
            try:
                r = dev.core.access(layer, experts, int(phase), next_use, up, lease_id,
                                    release_id)
            except CoreError as err:
                raise refusal(err, layer, self._n_expert) from None
            decided = self._decided(dev, layer, phase, r, lease_id)
        return self._answer(device, *decided)

    def step(self, device: str, held: int, layer: int, experts, phase: Phase) -> LayerAccess:
        """One consumer's layer-step, the core's step (rc_step): lease ``layer``'s experts and
        end ``held`` (an earlier step's ``lease_id``, 0: none) in one call. The access's
        ``lease_id`` is the new lease: hand it to the next step, then to ``step_end``. A
        refusal (UserError) has ended ``held`` all the same."""
        dev = self._device(device)
        with self._lock:
            try:
                lease_id, r = dev.core.step(held, layer, experts, int(phase))
            except CoreError as err:
                raise refusal(err, layer, self._n_expert) from None
            decided = self._decided(dev, layer, phase, r, lease_id)
        return self._answer(device, *decided)

    def step_end(self, device: str, held: int) -> None:
        """End a consumer's last step's lease (rc_step_end: its batch ended)."""
        dev = self._device(device)
        with self._lock:
            dev.core.step_end(held)

    def _answer(self, device: str, access: LayerAccess, submit: list[Ticket],
                drops: list[ExpertKey]) -> LayerAccess:
        """A decided call's answer, its transfer notices sent first (after the lock, as
        TransferNotices.send wants)."""
        if submit or drops:
            TransferNotices.send(self._transport, device, submit, drops)
        return access

    def _decided(self, dev: Device, layer: int, phase: Phase, r, lease_id: int
                 ) -> tuple[LayerAccess, list[Ticket], list[ExpertKey]]:
        """A core call's decisions (``CoreAccess``) as a LayerAccess, and the transfer notices
        and drops it owes a real transport (under the lock)."""
        hits, misses, tr, dmb, admitted, evicted, transient, prefetched = r  # CoreAccess
        keys = self._keys
        adm = tuple([keys[f] for f in admitted]) if admitted else _EMPTY
        ev = tuple([keys[f] for f in evicted]) if evicted else _EMPTY
        tra = tuple([keys[f] for f in transient]) if transient else _EMPTY
        access = _new_tuple(LayerAccess, (dev.name, layer, phase, hits, misses, dmb, adm, ev,
                                          tra, tr, lease_id))
        if dev.sim:
            return access, _NONE, _NONE
        submit, drops = self._notices.of(dev.name, phase, adm, ev, prefetched, keys,
                                         self._expert_bytes)
        return access, submit, drops

    def replay(self, device: str, bounds: np.ndarray, layers: np.ndarray, phases: np.ndarray,
               experts: np.ndarray, next_use: np.ndarray | None = None,
               upcoming: bool = False) -> ReplayOutcome:
        """Replay: every layer batch ``experts[bounds[b]:bounds[b + 1]]`` (layer ``layers[b]``,
        phase ``phases[b]``) as one access, in order, with no lease: the same decisions as that
        many ``access_layer(..., lease=False)`` calls, in one core call. ``next_use`` (one per
        row) for offline policies; ``upcoming``: hand each batch the next one (prefetch belady).
        Returns a ReplayOutcome (each row's miss kind, and every prefetch issued with the
        batch that issued it). Simulated devices only (nothing is moved)."""
        dev = self._device(device)
        if not dev.sim:
            raise RuntimeError(f"replay: {device} is served by a real transport")
        experts, layers = np.asarray(experts), np.asarray(layers)
        problem = replay_problem(experts, layers, self._n_expert, len(self._expert_bytes),
                                 self._moe_layers)
        if problem is not None:
            raise UserError(f"replay: {problem}")
        with self._lock:
            try:
                return dev.replay(bounds, layers, phases, experts, next_use, upcoming)
            except CoreError as err:
                raise refusal(err, -1, self._n_expert) from None

    def release(self, access: LayerAccess) -> None:
        """End the leases of an access. Idempotent."""
        with self._lock:
            self._release_locked(access)

    def _release_locked(self, access: LayerAccess) -> None:
        dev = self._devices.get(access.device)
        if dev is not None and access.lease_id:
            dev.core.release(access.lease_id)

    # ---- prefetch and failed transfers ----------------------------------------------------
    def prefetch(self, device: str, keys: Sequence[ExpertKey], phase: Phase) -> list[Ticket]:
        """Bring ``keys`` in ahead of demand where the eviction order allows (resident at once);
        the transfer notices issued.

        Prefetch is speculative: it never evicts a leased expert or one the eviction policy
        ranks above the prefetched key, and it does nothing in MIXED batches.
        """
        dev = self._device(device)
        ne = self._n_expert
        with self._lock:
            try:
                r = dev.core.prefetch([k.layer * ne + k.expert for k in keys], int(phase))
            except CoreError:
                raise UserError(f"prefetch: {device}: a key is not a routed expert of the "
                                "model") from None
            issued, drops = self._notices.of(device, phase, _EMPTY, _EMPTY, r.prefetched,
                                             self._keys, self._expert_bytes)
        if not dev.sim:
            TransferNotices.send(self._transport, device, issued, drops)
        return issued

    def transfer_failed(self, ticket: Ticket) -> bool:
        """The transport could not move ``ticket``'s expert: it leaves the device (its victims
        stay evicted), so manager and device agree. False when it is not resident."""
        with self._lock:
            dev = self._devices[ticket.device]
            key = ticket.key
            return dev.core.forget(key.layer * self._n_expert + key.expert) == 0

    # ---- static devices ------------------------------------------------------------------
    def plan_static(self, device: str, skip: tuple[int, ...] = ()) -> static_plan.StaticPlan:
        """The static plan for ``device`` at its resolved capacity (changes nothing); layers
        in ``skip`` stay off it (``static.first_fitting_layers``). UserError before
        bind_model / resolve_device or for an unknown device."""
        with self._lock:
            self._device(device)
        capacity = self.capacity(device)
        if capacity is None:
            raise UserError(f"{device}: plan_static needs a resolved capacity (resolve_device)")
        return static_plan.plan(device, self._expert_bytes.tolist(), self._n_expert, capacity,
                                skip)

    def pin_static(self, device: str, plan: static_plan.StaticPlan) -> None:
        """Make ``plan``'s experts resident on ``device`` for good and mark it static; refused
        (UserError) as ``static.plan_problem`` says."""
        capacity = self.capacity(device)
        with self._lock:
            static_plan.pin(self._device(device), plan, capacity, self._expert_bytes.tolist(),
                            self._n_expert)

    def is_static(self, device: str) -> bool:
        dev = self._devices.get(device)
        return dev is not None and dev.static

    def warm_start(self, device: str, profile) -> None:
        """Seed the device's learned policies (eviction next-visit, prefetch affinity) from a
        RoutingProfile (runtime/residency/profile.py); UserError for another model's."""
        dev = self._device(device)            # UserError before bind_model too
        profile.check_model(len(self._expert_bytes), self._n_expert, self._expert_bytes,
                            "profile")
        with self._lock:
            dev.core.warm_start(profile.frequency, profile.pair, profile.count,
                                profile.history)

    # ---- queries -------------------------------------------------------------------------
    def is_resident(self, device: str, key: ExpertKey) -> bool:
        dev = self._device(device)
        with self._lock:
            return dev.core.state(key.layer * self._n_expert + key.expert) <= RESIDENT_MAX

    def resident_mask(self, device: str, layer: int) -> np.ndarray:
        """(n_expert,) bool: which experts of ``layer`` are resident on ``device`` (a copy)."""
        dev = self._device(device)
        with self._lock:
            return dev.core.states()[layer] <= RESIDENT_MAX

    def capacity(self, device: str) -> int | None:
        """The device's capacity (all pools), or None while a pool is unresolved."""
        dev = self._devices.get(device)
        if dev is None:
            return None
        with self._lock:
            caps = [dev.core.pool_stats(i).capacity for i in range(len(dev.pools))]
        return None if any(c < 0 for c in caps) else sum(caps)

    def unresolved_reason(self, device: str) -> str | None:
        """Why nothing is admitted on ``device`` (None once its capacity is set)."""
        if self._expert_bytes is None:
            return "no model bound yet (bind_model)"
        dev = self._devices.get(device)
        if dev is None:
            return f"unknown device {device!r}"
        return dev.reason or None

    @property
    def devices(self) -> tuple[str, ...]:
        return tuple(self._devices)

    def core_handle(self, device: str):
        """The C core of ``device`` (a cffi pointer the routing hook feeds directly), or None
        when the manager runs the Python reference."""
        core = self._device(device).core
        return getattr(core, "_c", None)

    @property
    def n_expert(self) -> int:
        return self._n_expert

    @property
    def moe_layers(self) -> tuple[int, ...]:
        return self._moe_layers

    def verify(self) -> None:
        """Assert every bookkeeping invariant (tests and debugging; O(experts))."""
        with self._lock:
            for dev in self._devices.values():
                code = dev.core.verify()
                assert code == 0, f"{dev.name}: residency core invariant {code} broken"

    def snapshot(self, experts: bool = False) -> ResidencySnapshot:
        """Counters and occupancy of every device and pool, frozen; with ``experts`` also
        each device's ExpertMap (O(layers x experts); only the copies are made under the
        lock)."""
        with self._lock:
            taken = [(d.snapshot(), (d.core.states(), d.core.use_counts()) if experts else None)
                     for d in self._devices.values()]
        return ResidencySnapshot(tuple(snap if raw is None else
                                       replace(snap, experts=expert_map(*raw,
                                                                        self._moe_layers))
                                       for snap, raw in taken))
