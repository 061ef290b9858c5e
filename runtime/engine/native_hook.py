"""The routing hook in C (route_hook.c): ``cb_eval`` without a Python call per layer-step.

``NativeHook`` is a ``RoutingHook`` whose callback is the C hook. Per decode call it runs in
one of two modes:

  native   every observer can wait for the batch's end (``synchronous = False``: the trace
           recorder) and the devices the engine feeds are bookkeeping only: the C hook reads
           each MoE layer's router output, frames it as RouteAssembler does, calls the residency
           core of every fed device (one access per layer-step, the previous one's lease
           released in the same call), and buffers the event; ``end_batch`` hands the buffered
           events to the observers once per decode call;
           The RAM tier (``add_tier``) and the native device cache (``add_cache``) are stepped
           in C there too, before the layer's expert matmul runs (reads, copies);
  forward  an observer must run between a layer's router and its experts (any Python
           observer that does not say otherwise): the C hook only filters node names and calls
           the Python callback, which works as RoutingHook always did; the fed devices get a
           ResidencyObserver, and the tier and caches are observers that call the same C.

Both modes make the same decisions and the same events (tests compare them).
"""
from __future__ import annotations

import ctypes

import numpy as np

from runtime.engine.residency_observer import ResidencyObserver
from runtime.engine.routing_hook import RouteAssembler, RouteCaptureError, RouteEvent, RoutingHook
from runtime.residency.types import Phase

RH_FORWARD, RH_NATIVE, RH_ROUTE_ONLY = 0, 1, 2
RH_CONSUMER_CORE, RH_CONSUMER_CACHE, RH_CONSUMER_TIER = 0, 1, 2
_PHASES = (Phase.PREFILL, Phase.DECODE, Phase.MIXED)


class _CFilter:
    """The C hook's name filter, as RoutingHook drives its route filter."""

    def __init__(self, hook: NativeHook):
        self._hook = hook
        self.prefixes: list[bytes] = []

    def _apply(self, prefixes: list[bytes]) -> None:
        h = self._hook
        keep = [h.ffi.new("char[]", p) for p in prefixes]
        arr = h.ffi.new("char *[]", keep)
        if h.lib.rh_set_prefixes(h.handle, arr, len(prefixes)) != 0:
            raise ValueError("too many or too long prefixes for the route filter")
        self.prefixes = list(prefixes)

    def add_prefix(self, prefix: bytes) -> None:
        if prefix not in self.prefixes:
            self._apply([*self.prefixes, prefix])

    def set_prefixes(self, prefixes: list[bytes]) -> None:
        self._apply(list(prefixes))


class NativeHook(RoutingHook):
    """See the module docstring. ``feed(manager, devices)`` takes the devices the engine's
    ResidencyObserver would feed."""

    def __init__(self, assembler: RouteAssembler, n_layer: int):
        from runtime.engine import llama_lib  # noqa: PLC0415
        from runtime.engine.routing_hook import _FILTER_PREFIXES  # noqa: PLC0415
        from runtime.residency.core.build import load_core  # noqa: PLC0415

        super().__init__(assembler)
        lib, ffi = load_core()
        self.lib, self.ffi = lib, ffi
        is_moe = ffi.new("uint8_t[]", [1 if i in set(assembler.moe_layers) else 0
                                       for i in range(n_layer)])
        get = ctypes.cast(llama_lib.ggml().base.ggml_backend_tensor_get, ctypes.c_void_p).value
        t = llama_lib.GgmlTensor
        handle = lib.rh_create(n_layer, is_moe, assembler.n_expert_used,
                               ffi.cast("rh_tensor_get", get), t.type.offset, t.ne.offset,
                               t.nb.offset, t.name.offset)
        if handle == ffi.NULL:
            raise MemoryError("rh_create failed")
        self.handle = ffi.gc(handle, lib.rh_free)
        forward = ctypes.cast(self._py_callback, ctypes.c_void_p).value
        lib.rh_set_forward(self.handle, ffi.cast("rh_eval_cb", forward), ffi.NULL)
        self._filter = _CFilter(self)
        self._filter.set_prefixes(list(_FILTER_PREFIXES))
        callback_type = llama_lib.bindings().ggml_backend_sched_eval_callback
        self.callback = callback_type(int(ffi.cast("uintptr_t", lib.rh_eval)))
        self.user_data = ctypes.c_void_p(int(ffi.cast("uintptr_t", self.handle)))
        self._feed: ResidencyObserver | None = None
        self._cores: list = []
        self._caches: list = []
        self._tiers: list = []
        self._native_batch = False
        self._in_native_batch = False
        self._imposed = None                # ImposedRouting (route-only mode when alone)
        self._route_only = False
        self._phase = Phase.PREFILL
        self._n_tokens = 0

    # -- wiring ---------------------------------------------------------------------------
    def feed(self, manager, devices) -> None:
        """Keep ``devices`` of ``manager`` informed of every route (bookkeeping devices)."""
        self._feed = ResidencyObserver(manager, devices)
        self._cores = [manager.core_handle(d) for d in devices]
        self.lib.rh_clear_consumers(self.handle, RH_CONSUMER_CORE)
        if all(c is not None for c in self._cores):
            for c in self._cores:
                self._add_consumer(RH_CONSUMER_CORE, c)

    def add_cache(self, cache) -> None:
        """A native device cache (runtime.native.device_cache.DeviceCache) to drive."""
        self._add_consumer(RH_CONSUMER_CACHE, cache.native_handle)
        self._caches.append(cache)

    def add_tier(self, tier) -> None:
        """A RAM tier (runtime.ramtier.RamTier) to step before each layer's expert matmul."""
        self._add_consumer(RH_CONSUMER_TIER, tier.native_handle)
        self._tiers.append(tier)

    def _add_consumer(self, kind: int, handle) -> None:
        if self.lib.rh_add_consumer(self.handle, kind, handle) != 0:
            raise ValueError("too many consumers for the routing hook")

    def impose(self, routing, n_expert: int) -> None:
        """Route as ``routing`` (runtime.engine.imposed_routing.ImposedRouting) says."""
        from runtime.engine import llama_lib  # noqa: PLC0415

        tensor_set = ctypes.cast(llama_lib.ggml().base.ggml_backend_tensor_set,
                                 ctypes.c_void_p).value
        experts = np.ascontiguousarray(routing.experts, dtype=np.int32)
        logits = np.ascontiguousarray(routing.logits, dtype=np.float32)
        if self.lib.rh_set_route(self.handle, self.ffi.cast("rh_tensor_set", tensor_set),
                                 routing.n_positions, n_expert,
                                 self.ffi.from_buffer("int32_t[]", experts),
                                 self.ffi.from_buffer("float[]", logits)) != 0:
            raise ValueError(f"{routing.source}: the routing hook refused the trace")
        self._imposed = routing

    def _own(self) -> list:
        """The observers the hook itself runs natively (or hands to forward mode)."""
        return [o for o in (self._feed, *self._caches, *self._tiers) if o is not None]

    def _can_run_native(self) -> bool:
        if any(c is None for c in self._cores):
            return False                          # a reference core: forward mode only
        if self.watchers:
            return False                          # watched nodes go to Python callbacks
        own = self._own()
        observers = [o for o in self.assembler.observers if all(o is not x for x in own)]
        return all(getattr(o, "synchronous", True) is False for o in observers)

    @property
    def native_filter(self) -> bool:
        """The C name filter is in front of the Python callback (always, here)."""
        return True

    @property
    def native(self) -> bool:
        """True when the next decode call runs in native mode."""
        return self._can_run_native()

    # -- framing --------------------------------------------------------------------------
    def begin_batch(self, phase, first_step: int, n_tokens: int, n_outputs: int) -> None:
        self.error = None
        self._phase, self._n_tokens = Phase(phase), n_tokens
        if self._imposed is not None:
            self.lib.rh_route_batch(self.handle, first_step)
        # imposed routing and nothing to feed: the hook only sets the router's logits
        self._route_only = self._imposed is not None and not self._own() and \
            not self.assembler.observers and not self.watchers
        if self._route_only:
            self.lib.rh_set_mode(self.handle, RH_ROUTE_ONLY)
            return
        self._native_batch = self._can_run_native()
        observers = self.assembler.observers
        own = self._own()
        if self._native_batch:
            observers[:] = [o for o in observers if all(o is not x for x in own)]
            self.lib.rh_set_mode(self.handle, RH_NATIVE)
            self._in_native_batch = True
            self.lib.rh_begin_batch(self.handle, int(phase), first_step, n_tokens, n_outputs,
                                    self.assembler.turn, int(self.assembler.strict))
        else:
            missing = [o for o in own if all(o is not x for x in observers)]
            observers[:0] = missing
            self.lib.rh_set_mode(self.handle, RH_FORWARD)
            super().begin_batch(phase, first_step, n_tokens, n_outputs)

    @property
    def in_batch(self) -> bool:
        return self._in_native_batch or self.assembler.in_batch

    def abort_batch(self) -> None:
        if self._in_native_batch:
            self.lib.rh_abort_batch(self.handle)
            self._in_native_batch = False
        super().abort_batch()

    def _check_route(self) -> None:
        if self._imposed is None:
            return
        why = self.lib.rh_route_error(self.handle)
        if why != self.ffi.NULL:
            if not self._route_only:
                self.abort_batch()
            raise RouteCaptureError(self.ffi.string(why).decode())

    def end_batch(self) -> None:
        self._check_route()
        if self._route_only:
            return
        if not self._native_batch:
            super().end_batch()
            return
        lib, ffi, h = self.lib, self.ffi, self.handle
        self._in_native_batch = False
        if lib.rh_end_batch(h) != 0:
            message = ffi.string(lib.rh_error(h)).decode()
            self.assembler.abort_batch()
            raise RouteCaptureError(message)
        a = self.assembler
        if len(a.final_stage) < len(a.moe_layers):     # learnt once, for forward mode
            for layer in a.moe_layers:
                stage = lib.rh_final_stage(h, layer)
                if stage >= 0:
                    a.final_stage.setdefault(layer, stage)
        for cache in self._caches:
            cache.check_failures()
        for tier in self._tiers:
            tier.after_batch()
        if not a.observers:             # the hook's own cores and caches took every event
            return
        k = a.n_expert_used
        n_events = lib.rh_n_events(h)
        meta = np.empty((n_events, 6), dtype=np.int64)
        n = lib.rh_events_elems(h)
        experts = np.empty(max(n, k), dtype=np.int32)
        weights = np.empty(max(n, k), dtype=np.float32)
        lib.rh_copy_events(h, ffi.from_buffer("int64_t[]", meta),
                           ffi.from_buffer("int32_t[]", experts),
                           ffi.from_buffer("float[]", weights))
        experts = experts.reshape(-1, k)                # (rows of every event, k)
        weights = weights.reshape(-1, k)
        events = [RouteEvent(layer, _PHASES[phase], first, turn,
                             experts[at // k:at // k + rows], weights[at // k:at // k + rows])
                  for layer, phase, first, turn, rows, at in meta.tolist()]
        for observer in a.observers:
            for event in events:
                observer.on_route(event)
        for observer in a.observers:
            observer.on_batch_end(self._phase, self._n_tokens)
