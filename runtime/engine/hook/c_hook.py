"""The routing hook in C (route_hook.c): ``cb_eval`` with no Python call per layer-step.

The C hook is the only live framing of routing events: it reads each MoE layer's router
output, frames it into an event (RouteAssembler's rules: reference.py is the slow reference
the tests compare against) and steps its one list of consumers before the layer's expert
matmuls run:

  bookkeeping cores  ``feed(manager, devices)``: the manager's C core of each device
                     (``rc_step``); a manager running the Python reference core gets one
                     ResidencyObserver behind the observer adapter instead
  device caches      ``add_cache``: copies into slots and the layer's id planes (``dc_route``)
  RAM tiers          ``add_tier``: the layer's experts paged in (``rt_step``)
  observer adapter   the Python observers that must run between a layer's router and its
                     experts (the default; tests, diagnostics): one call per event

Observers that declare ``synchronous = False`` (the trace recorder) get the batch's events at
its end instead (``end_batch``), with no Python call on a layer-step. ``watch`` hands watched
nodes' data to Python. Imposed routing alone (``impose``, nothing to feed or observe) runs the
hook in route-only mode.

The hook is configured from its own description (config.HookConfig: the layers to read, k,
strict), which the engine builds; RouteAssembler, the reference, is built from the same one.
"""
from __future__ import annotations

import ctypes
from collections.abc import Callable

import numpy as np

from runtime.clib import load_library
from runtime.engine.hook.config import HookConfig
from runtime.engine.hook.events import RouteCaptureError, RouteEvent, RouteObserver, raise_failure
from runtime.engine.hook.residency_observer import ResidencyObserver
from runtime.residency.types import Phase

_PHASES = (Phase.PREFILL, Phase.DECODE, Phase.MIXED)


class CHook:
    """See the module docstring. ``config`` says which layers to read and how (its
    ``strict``); ``turn`` is the turn the next batches' events carry (the engine sets it per
    generation); ``add_observer`` adds the engine's observers. Keep the hook alive as long as
    the context."""

    def __init__(self, config: HookConfig):
        from runtime.native import ggml_lib, ggml_tensor, llama_lib  # noqa: PLC0415
        lib, ffi = load_library()
        self.lib, self.ffi = lib, ffi
        self._ggml, self._tensors = ggml_lib, ggml_tensor
        self.config = config
        self.turn = 0
        self.observers: list[RouteObserver] = []      # the engine's, in the order added
        n_layer, moe = config.n_layer, set(config.moe_layers)
        is_moe = ffi.new("uint8_t[]", [1 if i in moe else 0 for i in range(n_layer)])
        get = ctypes.cast(ggml_lib.ggml().base.ggml_backend_tensor_get, ctypes.c_void_p).value
        t = ggml_tensor.GgmlTensor
        handle = lib.rh_create(n_layer, is_moe, config.n_expert_used,
                               ffi.cast("rh_tensor_get", get), t.type.offset, t.ne.offset,
                               t.nb.offset, t.name.offset)
        if handle == ffi.NULL:
            raise MemoryError("rh_create failed")
        self.handle = ffi.gc(handle, lib.rh_free)
        callback_type = llama_lib.bindings().ggml_backend_sched_eval_callback
        self.callback = callback_type(int(ffi.cast("uintptr_t", lib.rh_eval)))
        self.user_data = ctypes.c_void_p(int(ffi.cast("uintptr_t", self.handle)))
        self.error: BaseException | None = None       # a Python observer's or watcher's
        self.watchers: dict[bytes, Callable[[str, np.ndarray], None]] = {}
        self._on_event_c = ffi.callback("rh_event_cb", self._on_event)
        self._on_watch_c = ffi.callback("rh_eval_cb", self._on_watch)
        self._observing = False                       # the adapter is on the list
        self._batch_observers: list = []              # this batch's observers (all)
        self._sync: list = []                         # ... and the synchronous ones
        self._feed: ResidencyObserver | None = None   # reference cores: Python bookkeeping
        self._n_cores = 0                             # C consumers: cores, caches, tiers
        self._caches: list = []
        self._tiers: list = []
        self._in_batch = False
        self._imposed = None                # ImposedRouting (route-only mode when alone)
        self._route_only = False
        self._phase = Phase.PREFILL
        self._n_tokens = 0

    # -- wiring ---------------------------------------------------------------------------
    def add_observer(self, observer: RouteObserver) -> None:
        """Receive every route event (``synchronous = False``: a batch's, at its end)."""
        self.observers.append(observer)

    def feed(self, manager, devices) -> None:
        """Keep ``devices`` of ``manager`` informed of every route (bookkeeping devices)."""
        cores = [manager.core_handle(d) for d in devices]
        self.lib.rh_clear_consumers(self.handle, self.lib.RH_CONSUMER_CORE)
        self._n_cores, self._feed = 0, None
        if any(c is None for c in cores):         # the Python reference core
            self._feed = ResidencyObserver(manager, devices)
            return
        for c in cores:
            self._add_consumer(self.lib.RH_CONSUMER_CORE, c)
        self._n_cores = len(cores)

    def add_cache(self, cache) -> None:
        """A device cache (runtime.native.device_cache.DeviceCache) to drive."""
        self._add_consumer(self.lib.RH_CONSUMER_CACHE, cache.native_handle)
        self._caches.append(cache)

    def add_tier(self, tier) -> None:
        """A RAM tier (runtime.ramtier.RamTier) to step before each layer's expert matmul."""
        self._add_consumer(self.lib.RH_CONSUMER_TIER, tier.native_handle)
        self._tiers.append(tier)

    def _add_consumer(self, kind: int, handle) -> None:
        if self.lib.rh_add_consumer(self.handle, kind, handle) != 0:
            raise ValueError("too many consumers for the routing hook")

    def watch(self, name: str, fn: Callable[[str, np.ndarray], None]) -> None:
        """Also read node ``name`` (exact match, e.g. ``"ffn_moe_probs-3"``; it must start with
        ``ffn_moe_``) and pass its data (shape (ne3, ne2, ne1, ne0)) to ``fn``. For tests and
        diagnostics."""
        if not name.startswith("ffn_moe_"):
            raise ValueError(f"{name!r}: only ffn_moe_* nodes can be watched")
        watchers = {**self.watchers, name.encode(): fn}
        keep = [self.ffi.new("char[]", n) for n in watchers]
        if self.lib.rh_set_watch(self.handle, self._on_watch_c, self.ffi.NULL,
                                 self.ffi.new("char *[]", keep), len(keep)) != 0:
            raise ValueError(f"{name!r}: too many or too long watched names")
        self.watchers = watchers

    def impose(self, routing, n_expert: int) -> None:
        """Route as ``routing`` (runtime.engine.hook.imposed_routing.ImposedRouting) says."""
        tensor_set = ctypes.cast(self._ggml.ggml().base.ggml_backend_tensor_set,
                                 ctypes.c_void_p).value
        experts = np.ascontiguousarray(routing.experts, dtype=np.int32)
        logits = np.ascontiguousarray(routing.logits, dtype=np.float32)
        if self.lib.rh_set_route(self.handle, self.ffi.cast("rh_tensor_set", tensor_set),
                                 routing.n_positions, n_expert,
                                 self.ffi.from_buffer("int32_t[]", experts),
                                 self.ffi.from_buffer("float[]", logits)) != 0:
            raise ValueError(f"{routing.source}: the routing hook refused the trace")
        self._imposed = routing

    def _observers(self) -> list:
        """Every Python observer: the reference cores' bookkeeping first, then the engine's."""
        return [self._feed, *self.observers] if self._feed is not None else list(self.observers)

    # -- the adapter and the watched nodes (called from C, on the decoding thread) --------
    def _on_event(self, layer, phase, first_step, turn, n_rows, experts, weights, _user) -> int:
        try:
            if self.error is not None:
                return 1
            k = self.config.n_expert_used
            n = 4 * n_rows * k                                   # bytes
            event = RouteEvent(layer, _PHASES[phase], first_step, turn,
                               np.frombuffer(self.ffi.buffer(experts, n), np.int32)
                               .reshape(n_rows, k).copy(),
                               np.frombuffer(self.ffi.buffer(weights, n), np.float32)
                               .reshape(n_rows, k).copy())
            for observer in self._sync:
                observer.on_route(event)
            return 0
        except BaseException as exc:  # noqa: BLE001 - must never escape into C
            if self.error is None:
                self.error = exc
            return 1

    def _on_watch(self, tensor, ask, _user) -> bool:
        try:
            address = int(self.ffi.cast("uintptr_t", tensor))
            name = self._tensors.tensor_name(address)
            self.watchers[name](name.decode(), self._tensors.read_tensor(address))
            return True
        except BaseException as exc:  # noqa: BLE001 - must never escape into C
            if self.error is None:
                self.error = exc
            return False                  # a data call: the graph stops

    # -- framing --------------------------------------------------------------------------
    def begin_batch(self, phase, first_step: int, n_tokens: int, n_outputs: int) -> None:
        self.error = None
        self._phase, self._n_tokens = Phase(phase), n_tokens
        if self._imposed is not None:
            self.lib.rh_route_batch(self.handle, first_step)
        observers = self._batch_observers = self._observers()
        # imposed routing and nothing to feed: the hook only sets the router's logits
        self._route_only = self._imposed is not None and not (
            self._n_cores or self._caches or self._tiers or observers or self.watchers)
        if self._route_only:
            self.lib.rh_set_mode(self.handle, self.lib.RH_ROUTE_ONLY)
            return
        self._sync = [o for o in observers if getattr(o, "synchronous", True)]
        if bool(self._sync) != self._observing:
            self._observing = bool(self._sync)
            self.lib.rh_set_observer(self.handle, self._on_event_c if self._observing
                                     else self.ffi.NULL, self.ffi.NULL)
        self.lib.rh_set_mode(self.handle, self.lib.RH_NATIVE)
        self._in_batch = True
        self.lib.rh_begin_batch(self.handle, int(phase), first_step, n_tokens, n_outputs,
                                self.turn, int(self.config.strict))

    @property
    def in_batch(self) -> bool:
        """Between begin_batch and the end (or abort) of a decode call."""
        return self._in_batch

    def abort_batch(self) -> None:
        """The decode failed: the consumers and observers still end the batch (leases end)."""
        if self._in_batch:
            self.lib.rh_abort_batch(self.handle)
            self._in_batch = False
            self._end_observers(failed=True)

    def _end_observers(self, failed: bool = False) -> None:
        for observer in self._batch_observers:
            try:
                observer.on_batch_end(self._phase, self._n_tokens)
            except Exception:  # noqa: BLE001 - after a failure, the original error is reported
                if not failed:
                    raise

    def _check_route(self) -> None:
        if self._imposed is None:
            return
        why = self.lib.rh_route_error(self.handle)
        if why != self.ffi.NULL:
            self.abort_batch()
            raise RouteCaptureError(self.ffi.string(why).decode())

    def end_batch(self) -> None:
        """After ``llama_decode``: raise what went wrong inside the graph, else hand the
        batch's events to the observers that wait for it and end every observer's batch."""
        self._check_route()
        if self._route_only:
            return
        lib, ffi, h = self.lib, self.ffi, self.handle
        error, self.error = self.error, None
        if error is not None:
            self.abort_batch()
            raise_failure(error)
        self._in_batch = False
        if lib.rh_end_batch(h) != 0:
            message = ffi.string(lib.rh_error(h)).decode()
            self._end_observers(failed=True)
            raise RouteCaptureError(message)
        for cache in self._caches:
            cache.check_failures()
        for tier in self._tiers:
            tier.after_batch()
        waiting = [o for o in self._batch_observers if not getattr(o, "synchronous", True)]
        if waiting:
            events = self._events()
            for observer in waiting:
                for event in events:
                    observer.on_route(event)
        self._end_observers()

    def _events(self) -> list[RouteEvent]:
        """The batch's events, copied out of the C hook at once."""
        lib, ffi, h = self.lib, self.ffi, self.handle
        k = self.config.n_expert_used
        meta = np.empty((lib.rh_n_events(h), 6), dtype=np.int64)
        n = lib.rh_events_elems(h)
        experts = np.empty(max(n, k), dtype=np.int32)
        weights = np.empty(max(n, k), dtype=np.float32)
        lib.rh_copy_events(h, ffi.from_buffer("int64_t[]", meta),
                           ffi.from_buffer("int32_t[]", experts),
                           ffi.from_buffer("float[]", weights))
        experts = experts.reshape(-1, k)                # (rows of every event, k)
        weights = weights.reshape(-1, k)
        return [RouteEvent(layer, _PHASES[phase], first, turn,
                           experts[at // k:at // k + rows], weights[at // k:at // k + rows])
                for layer, phase, first, turn, rows, at in meta.tolist()]
