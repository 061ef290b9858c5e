"""The device cache: slots on a device, filled and emptied by the residency
manager's decisions, read by the patched llama.cpp graph.

    cache = attach(engine)     # the engine calls this when the config has cuda:N / cpu-slots

For each such device, ``DeviceCache`` is both the manager's (inline) Transport for that device
and a RouteObserver. ``submit(ticket)`` picks a free slot of the expert's pool (the victims'
slots were freed by ``drop`` just before) and queues the copy of the expert's bytes from a
read-only mmap of the GGUF file into the slot on a pool of worker threads (>= 4 copies in
flight, no lock held while bytes move). Finished copies are *published* (table entry set) only at safe points: when a layer routes
(``on_route``: the scheduler has synchronized and this layer has not read its tables yet) and
when a batch ends, which waits for every copy the batch started (so between batches the tables
hold exactly the manager's resident set). In prefill the layer waits for its own admissions so
the whole chunk uses them; in decode it does not (the expert runs cold until its copy is
published, at the latest when the token ends). The manager
decides everything (admission, eviction, prefetch, per phase, per pool: the cache's pools are
the manager's) at once, whatever the copies are doing; this module only moves bytes.

Invariant: a table entry points at a slot only while the slot holds that expert's bytes, and a
slot is written only when no table entry points at it and no copy into it runs.
"""
from __future__ import annotations

import mmap
import os
import sys
from pathlib import Path

import numpy as np

from runtime.clib import load_library
from runtime.native.build import STORE_LIB
from runtime.native.device_cache_store import (PROJ_BY_TENSOR, DeviceCacheError, DeviceCacheStore,
                                               check_same_libllama, ffi, load_store)
from runtime.native.pools import ggml_device_name, pools_of
from runtime.residency.config import is_cache_device
from runtime.residency.types import ExpertKey, LayerAccess, Phase, Ticket

COPY_WORKERS = 4            # copies in flight per device
# a copy into host-memory slots is a memcpy that competes for the same cores as the decode: an
# expert this small is copied inside its layer-step (and computed from its slot at once)
# instead of waking a worker; device slots always copy on the workers (DMA runs beside compute)
HOST_INLINE_COPY_BYTES = 256 << 10
_notified: set[str] = set()


def notice(message: str) -> None:
    """Print ``message`` once per process (stderr)."""
    if message not in _notified:
        _notified.add(message)
        print(f"moe-offload: {message}", file=sys.stderr)


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


def route_error(rc: int) -> str:
    """What a non-zero ``dc_route`` status means (one line)."""
    if rc <= -100:
        return f"the id planes could not be written (dc_store_route status {-100 - rc})"
    return f"the residency core refused the layer-step (status {rc})"


class DeviceCache:
    """One device's cache: the manager's (inline) Transport for its device, and a
    RouteObserver. The mechanism is C (runtime/native/device_cache.c, one ``dc_cache``): the
    routing hook's native mode calls it per layer-step without Python (``native_handle``);
    in the reference hook (hook/reference.py) ``on_route`` calls the same C code.

    The manager decides at once (an admitted expert is resident from its admission on); the C
    side moves the bytes: victims' table entries are cleared and their slots freed (or their
    copy cancelled), each admitted expert is copied into a free slot of its pool on worker
    threads and published (table entry set) at a safe point; until then the graph computes it
    cold, which changes speed, never the result or the manager's decisions. A copy that fails
    frees its slot and the expert leaves the manager too.
    """

    synchronous = True     # as an observer (the reference hook): between router and experts

    def __init__(self, manager, device: str, store: DeviceCacheStore, source: ExpertSource, *,
                 n_used: int, workers: int = COPY_WORKERS, wait_in_prefill: bool = True,
                 inline_copy_bytes: int = 0):
        self.manager, self.device, self.store, self.source = manager, device, store, source
        self.lib, self.ffi = load_library()
        n_layer, n_expert = store.n_layer, manager.n_expert
        self.n_expert = n_expert
        pool_of_layer = [store.layer_info(layer)[0] for layer in range(n_layer)]
        slots = [store.pool_info(p)[0] for p in range(store.n_pool)]
        store_ffi = ffi()
        table_set = int(store_ffi.cast("uintptr_t", store.lib.dc_store_table_set))
        slot_set = int(store_ffi.cast("uintptr_t", store.lib.dc_store_slot_set))
        route = int(store_ffi.cast("uintptr_t", store.lib.dc_store_route))
        f = self.ffi
        handle = self.lib.dc_create(
            manager.core_handle(device),
            f.cast("void *", int(store_ffi.cast("uintptr_t", store.handle))),
            f.cast("dc_table_set_fn", table_set), f.cast("dc_slot_set_fn", slot_set),
            f.cast("dc_route_fn", route), n_used, n_layer,
            n_expert, f.new("int32_t[]", pool_of_layer), len(slots), f.new("int32_t[]", slots),
            f.cast("char *", int(store_ffi.cast("uintptr_t", source.base))), max(workers, 4),
            int(wait_in_prefill))
        if handle == f.NULL:
            raise DeviceCacheError(f"{device}: the device cache could not start")
        self._dc = handle
        if inline_copy_bytes:
            self.lib.dc_set_inline_bytes(handle, int(inline_copy_bytes))
        for layer, parts in source.parts.items():
            self.lib.dc_set_parts(handle, layer, len(parts),
                                  f.new("int32_t[]", [p[0] for p in parts]),
                                  f.new("int64_t[]", [p[1] for p in parts]),
                                  f.new("int64_t[]", [p[2] for p in parts]))
        self._failures_seen = 0

    @property
    def native_handle(self):
        """The C cache (``dc_cache *``) the routing hook's native mode drives."""
        return self._dc

    # -- Transport ---------------------------------------------------------------------------
    def bind(self, manager) -> None:
        self.manager = manager

    def submit(self, ticket: Ticket) -> None:
        key = ticket.key
        self.lib.dc_submit(self._dc, key.layer * self.n_expert + key.expert,
                           int(ticket.prefetch))

    def drop(self, device: str, key: ExpertKey) -> None:
        self.lib.dc_drop(self._dc, key.layer * self.n_expert + key.expert)

    # -- RouteObserver (the reference hook, tests) -------------------------------------------
    def on_route(self, event) -> None:
        experts = np.ascontiguousarray(event.experts, dtype=np.int32).reshape(-1)
        rc = self.lib.dc_route(self._dc, event.layer, self.ffi.from_buffer("int32_t[]", experts),
                               len(experts), int(event.phase))
        if rc != 0:
            raise RuntimeError(f"{self.device}: layer {event.layer}: {route_error(rc)}")

    def on_batch_end(self, phase: Phase, n_tokens: int) -> None:
        # copies started in a batch complete before the next batch's decisions: the tables
        # hold exactly the manager's resident set between batches
        self.lib.dc_batch_end(self._dc)
        self.check_failures()

    def check_failures(self) -> None:
        """Say once that copies failed (the experts concerned stay cold)."""
        failures = self.copy_failures
        if failures > self._failures_seen:
            self._failures_seen = failures
            reason = self.ffi.string(self.lib.dc_error(self._dc)).decode()
            notice(f"{self.device}: an expert copy failed ({reason}); it stays cold")

    # -- state ---------------------------------------------------------------------------------
    def settle(self) -> None:
        """Wait for every copy in flight, then publish: tables and manager agree after it."""
        self.lib.dc_settle(self._dc)

    def publish(self) -> None:
        self.lib.dc_publish(self._dc)

    def fail_every(self, n: int) -> None:
        """Tests: make every nth copy fail (the real failure path, without a broken disk)."""
        self.lib.dc_fail_every(self._dc, n)

    def _stat(self, which: int) -> int:
        return int(self.lib.dc_stat(self._dc, which))

    copies = property(lambda self: self._stat(0))
    copy_failures = property(lambda self: self._stat(1))
    refused = property(lambda self: self._stat(2))
    copied_bytes = property(lambda self: self._stat(3))

    def resident(self) -> dict[ExpertKey, int]:
        """Expert -> slot for what is resident (published) now."""
        out = {}
        for layer in self.source.parts:
            for e in range(self.n_expert):
                slot = self.lib.dc_slot_of(self._dc, layer * self.n_expert + e)
                if slot >= 0:
                    out[ExpertKey(layer, e)] = slot
        return out

    @property
    def slot_of(self) -> dict[ExpertKey, int]:
        return self.resident()

    def pools(self) -> list:
        """The manager's pools for this cache (runtime/native/pools.py)."""
        return pools_of(self.store, self.manager.moe_layers)

    # -- lifetime ------------------------------------------------------------------------------
    def close(self) -> None:
        """Finish the copies in flight, then free the slots (before the model is freed)."""
        if self.store.handle is None:
            return
        if self._dc is not None:
            self.lib.dc_free(self._dc)
            self._dc = None
        self.store.close()
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
    """Serve the engine's cuda:N / vulkan:N / cpu-slots devices with device caches.
    Returns None (after saying why, once) when the loaded libllama is not the patched build."""
    manager = engine.manager
    devices = [b.device for b in engine.config.devices if is_cache_device(b.device)]
    if manager is None or not devices:
        return None
    lib_dir = _loaded_lib_dir()
    if lib_dir is None or not (lib_dir / STORE_LIB).is_file():
        backends = sorted({d.split(":")[0].replace("cpu-slots", "cpu") for d in devices})
        build = " && ".join(f"moe-offload native build --backend {b}" for b in backends)
        notice(f"{', '.join(devices)}: the device cache needs the patched llama.cpp "
               f"built for {'/'.join(b.upper() for b in backends)}, which is missing; "
               f"`{build}` makes it (it then loads by itself); running without it, these "
               "devices are bookkeeping only")
        return None
    reason = check_same_libllama(lib_dir)
    if reason:
        notice(f"device cache off: {reason}")
        return None
    from gguf_tools.expert_index import ExpertIndex  # noqa: PLC0415
    from runtime.residency.transport import claim_device  # noqa: PLC0415

    lib = load_store(lib_dir)
    index = ExpertIndex.open(engine.settings.model_path)
    caches: list[DeviceCache] = []
    devices.sort(key=lambda d: d == "cpu-slots")       # a GPU first
    for device in devices:
        if caches:     # libllama holds one slot table per layer: one cache device per model
            notice(f"{device}: the device cache serves one device per model "
                   f"({caches[0].device}); {device} is not served")
            continue
        capacity = manager.capacity(device)
        if not capacity:
            notice(f"{device}: no capacity resolved ({manager.unresolved_reason(device)}); "
                   "no device cache")
            continue
        try:
            name = (engine.remote.ggml_name(device) if device.startswith("rpc:")
                    else ggml_device_name(device))
            store = DeviceCacheStore.create(lib, engine.model_ptr, name, capacity,
                                            max_tokens=engine.n_ubatch)
        except DeviceCacheError as exc:
            notice(f"{device}: device cache off ({exc})")
            continue
        slot_bytes = sum(n * b for n, b in map(store.pool_info, range(store.n_pool)))
        if slot_bytes == 0:
            store.close()
            notice(f"{device}: a budget of {capacity} bytes holds no expert slot next to the "
                   f"{engine.facts.n_expert_used} sink slots the cache needs; no device cache")
            continue
        source = ExpertSource(engine.settings.model_path, index)
        host = name == "CPU"                  # host slots: small copies run inline
        cache = DeviceCache(manager, device, store, source,
                            n_used=engine.facts.n_expert_used,
                            inline_copy_bytes=HOST_INLINE_COPY_BYTES if host else 0)
        # the cache's pools (one per expert layout, its slots' bytes: the sinks live inside
        # the budget but are never charged) become the manager's, per pool
        manager.set_pools(device, cache.pools())
        claim_device(manager, device, cache)
        engine.hook.add_cache(cache)
        caches.append(cache)
    return DeviceCaches(caches) if caches else None
