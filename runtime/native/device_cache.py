"""The native device expert cache: slots on a device, filled and emptied by the residency
manager's decisions, read by the patched llama.cpp graph.

    cache = attach(engine)     # the engine calls this when the config has cuda:N / cpu-slots

For each such device, ``DeviceCache`` is both the manager's Transport for that device and a
RouteObserver. ``submit(ticket)`` picks a slot (a free one, else a victim's: its table entry is
cleared first) and queues the copy of the expert's bytes from a read-only mmap of the GGUF file
into the slot on a pool of worker threads (>= 4 copies in flight, no lock held while bytes
move). Finished copies are *published* (table entry set, then ``manager.commit``) only at safe
points: when a layer routes (``on_route``: the scheduler has synchronized and this layer has not
read its tables yet) and when a batch ends. In prefill the layer waits for its own admissions
so the whole chunk uses them; in decode it does not (the expert runs cold once). The manager
decides everything (admission, eviction, prefetch, per phase); this module only moves bytes.

Invariant: a table entry points at a slot only while the slot holds that expert's bytes, and a
slot is written only when no table entry points at it.
"""
from __future__ import annotations

import mmap
import os
import sys
import threading
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor, wait
from pathlib import Path

from runtime.native.shim import (PROJ_BY_TENSOR, ShimCache, ShimError, check_same_libllama, ffi,
                                 load_shim)
from runtime.residency.config import is_cache_device
from runtime.residency.types import ExpertKey, LayerAccess, Phase, Ticket

COPY_WORKERS = 4            # copies in flight per device
_GGML_NAMES = {"cuda": "CUDA", "vulkan": "Vulkan"}
_notified: set[str] = set()


def notice(message: str) -> None:
    """Print ``message`` once per process (stderr)."""
    if message not in _notified:
        _notified.add(message)
        print(f"moe-offload: {message}", file=sys.stderr)


def ggml_device_name(device: str) -> str:
    """Residency device -> ggml device name: "cpu-slots" -> "CPU", "cuda:1" -> "CUDA1",
    "vulkan:0" -> "Vulkan0"."""
    if device == "cpu-slots":
        return "CPU"
    kind, _, index = device.partition(":")
    if kind in _GGML_NAMES and index.isdigit():
        return f"{_GGML_NAMES[kind]}{int(index)}"
    raise ValueError(f"{device}: not a device the native cache serves (cuda:N, vulkan:N, "
                     "cpu-slots)")


class ExpertSource:
    """The experts' bytes in a read-only mmap of the GGUF file, per (layer, projection)."""

    def __init__(self, model_path: str, index):
        self._fd = os.open(model_path, os.O_RDONLY)
        self._map = mmap.mmap(self._fd, 0, access=mmap.ACCESS_READ)
        self.base = ffi().from_buffer("char[]", self._map)
        # layer -> ((proj, offset of expert 0, bytes per expert), ...)
        self.parts: dict[int, tuple[tuple[int, int, int], ...]] = {}
        for layer in index.facts.moe_layers:
            parts = []
            for t in index.tensors(layer):
                stem = t.name.split(".")[-2] if t.name.endswith(".weight") else None
                if stem in PROJ_BY_TENSOR:
                    parts.append((PROJ_BY_TENSOR[stem], t.offset, t.expert_stride))
            self.parts[layer] = tuple(parts)

    def close(self) -> None:
        self.base = None
        self._map.close()
        os.close(self._fd)


class DeviceCache:
    """One device's slot cache: Transport (for its device) and RouteObserver."""

    inline = False

    def __init__(self, manager, device: str, cache: ShimCache, source: ExpertSource, *,
                 workers: int = COPY_WORKERS, wait_in_prefill: bool = True):
        self.manager, self.device, self.cache, self.source = manager, device, cache, source
        self.wait_in_prefill = wait_in_prefill
        n_layer = cache.n_layer
        self.pool_of_layer = [cache.layer_info(layer)[0] for layer in range(n_layer)]
        self.free: dict[int, list[int]] = {}
        for pool in range(cache.n_pool):
            n_slots, _ = cache.pool_info(pool)
            self.free[pool] = list(range(n_slots - 1, -1, -1))   # pop() hands out slot 0 first
        self.slot_of: dict[ExpertKey, int] = {}
        self._futures: dict[int, Future] = {}                 # ticket id -> its copy
        self._done: deque[tuple[Ticket, int, BaseException | None]] = deque()
        self._done_lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max(workers, 4), thread_name_prefix=f"slots-{device}")
        self._held: list[LayerAccess] = []
        self.copies = self.copy_failures = self.refused = 0
        self.copied_bytes = 0

    # -- Transport ---------------------------------------------------------------------------
    def bind(self, manager) -> None:
        self.manager = manager

    def submit(self, ticket: Ticket) -> None:
        slot = self._claim_slot(ticket)
        if slot is None:                     # no slot of this layer's layout: stays cold
            self.refused += 1
            self.manager.abort(ticket)
            return
        self._futures[ticket.id] = self._pool.submit(self._copy, ticket, slot)

    def drop(self, device: str, key: ExpertKey) -> None:
        slot = self.slot_of.pop(key, None)
        if slot is not None:
            self.cache.table_set(key.layer, key.expert, -1)
            self.free[self.pool_of_layer[key.layer]].append(slot)

    def _claim_slot(self, ticket: Ticket) -> int | None:
        layer = ticket.key.layer
        pool = self.pool_of_layer[layer] if 0 <= layer < len(self.pool_of_layer) else -1
        if pool < 0:
            return None
        if self.free[pool]:
            return self.free[pool].pop()
        for victim in ticket.victims:        # reserved by the manager: no longer hit-able
            slot = self.slot_of.get(victim)
            if slot is not None and self.pool_of_layer[victim.layer] == pool:
                del self.slot_of[victim]
                self.cache.table_set(victim.layer, victim.expert, -1)
                return slot
        return None

    def _copy(self, ticket: Ticket, slot: int) -> None:
        """Worker thread: the expert's bytes into ``slot`` (the shim call releases the GIL)."""
        error = None
        try:
            key = ticket.key
            for proj, offset, stride in self.source.parts[key.layer]:
                self.cache.slot_set(key.layer, slot, proj, self.source.base + offset
                                    + key.expert * stride, stride)
        except BaseException as exc:  # noqa: BLE001 - reported at publish, ticket aborted
            error = exc
        with self._done_lock:
            self._done.append((ticket, slot, error))

    def publish(self) -> int:
        """At a safe point: finished copies become resident (table, then commit)."""
        published = 0
        while True:
            with self._done_lock:
                if not self._done:
                    return published
                ticket, slot, error = self._done.popleft()
            self._futures.pop(ticket.id, None)
            key = ticket.key
            if error is not None:
                self.copy_failures += 1
                self.free[self.pool_of_layer[key.layer]].append(slot)
                self.manager.abort(ticket)
                notice(f"{self.device}: an expert copy failed ({error}); it stays cold")
                continue
            self.cache.table_set(key.layer, key.expert, slot)
            self.slot_of[key] = slot
            if not self.manager.commit(ticket):      # already finished elsewhere: undo
                self.drop(self.device, key)
                continue
            self.copies += 1
            self.copied_bytes += ticket.bytes
            published += 1

    def wait_copies(self, tickets) -> None:
        """Block until the copies of ``tickets`` (issued here) are done, then publish."""
        futures = [f for t in tickets if (f := self._futures.get(t.id)) is not None]
        if futures:
            wait(futures)
        self.publish()

    # -- RouteObserver ------------------------------------------------------------------------
    def on_route(self, event) -> None:
        self.publish()
        self._release()
        access = self.manager.access_layer(self.device, event.layer, event.experts.reshape(-1),
                                           event.phase, step=event.first_step)
        self._held.append(access)
        if access.tickets and self.wait_in_prefill and event.phase != Phase.DECODE:
            self.wait_copies(access.tickets)

    def on_batch_end(self, phase: Phase, n_tokens: int) -> None:
        self.publish()
        self._release()

    def _release(self) -> None:
        held, self._held = self._held, []
        for access in held:
            self.manager.release(access)

    # -- lifetime ------------------------------------------------------------------------------
    def resident(self) -> dict[ExpertKey, int]:
        """A copy of expert -> slot for what is resident (published) now."""
        return dict(self.slot_of)

    def close(self) -> None:
        """Finish the copies in flight, then free the slots (before the model is freed)."""
        if self.cache.handle is None:
            return
        self._pool.shutdown(wait=True)
        self.publish()
        self._release()
        self.cache.close()
        self.source.close()


class DeviceCaches:
    """The caches attach() made (one per device); ``close()`` closes them all."""

    def __init__(self, caches: list[DeviceCache]):
        self.caches = caches

    def by_device(self, device: str) -> DeviceCache:
        return next(c for c in self.caches if c.device == device)

    def close(self) -> None:
        for cache in self.caches:
            cache.close()


def _loaded_lib_dir() -> Path | None:
    import llama_cpp.llama_cpp as ll  # noqa: PLC0415

    name = getattr(getattr(ll, "_lib", None), "_name", None)
    return Path(name).resolve().parent if name else None


def attach(engine) -> DeviceCaches | None:
    """Serve the engine's cuda:N / vulkan:N / cpu-slots devices with native slot caches.
    Returns None (after saying why, once) when the loaded libllama is not the patched build."""
    manager = engine.manager
    devices = [b.device for b in engine.config.devices if is_cache_device(b.device)]
    if manager is None or not devices:
        return None
    lib_dir = _loaded_lib_dir()
    if lib_dir is None or not (lib_dir / "libmoe_cache.so").is_file():
        backends = sorted({d.split(":")[0].replace("cpu-slots", "cpu") for d in devices})
        build = " && ".join(f"moe-offload native build --backend {b}" for b in backends)
        notice(f"{', '.join(devices)}: the device expert cache needs the patched llama.cpp "
               f"built for {'/'.join(b.upper() for b in backends)}, which is missing; "
               f"`{build}` makes it (it then loads by itself); running on the stock CPU "
               "libraries, where these devices are bookkeeping only")
        return None
    reason = check_same_libllama(lib_dir)
    if reason:
        notice(f"device expert cache off: {reason}")
        return None
    from gguf_tools.expert_index import ExpertIndex  # noqa: PLC0415
    from runtime.ramtier.transport_mux import claim_device  # noqa: PLC0415

    lib = load_shim(lib_dir)
    index = ExpertIndex.open(engine.settings.model_path)
    caches: list[DeviceCache] = []
    devices.sort(key=lambda d: d == "cpu-slots")       # a GPU first
    for device in devices:
        if caches:     # libllama holds one slot table per layer: one cache device per model
            notice(f"{device}: the device expert cache serves one device per model "
                   f"({caches[0].device}); {device} is not served")
            continue
        capacity = manager.capacity(device)
        if not capacity:
            notice(f"{device}: no capacity resolved ({manager.unresolved_reason(device)}); "
                   "no device cache")
            continue
        try:
            shim_cache = ShimCache.create(lib, engine.model_ptr, ggml_device_name(device),
                                          capacity)
        except ShimError as exc:
            notice(f"{device}: device expert cache off ({exc})")
            continue
        slot_bytes = sum(n * b for n, b in map(shim_cache.pool_info, range(shim_cache.n_pool)))
        if slot_bytes == 0:
            shim_cache.close()
            notice(f"{device}: a budget of {capacity} bytes holds no expert slot next to the "
                   f"{engine.facts.n_expert_used} sink slots the cache needs; no device cache")
            continue
        if slot_bytes < capacity:      # the sinks live inside the budget: charge only the slots
            manager.reconfigure(device, slot_bytes)
        source = ExpertSource(engine.settings.model_path, index)
        cache = DeviceCache(manager, device, shim_cache, source)
        claim_device(manager, device, cache)
        engine.add_route_observer(cache)
        caches.append(cache)
    return DeviceCaches(caches) if caches else None
