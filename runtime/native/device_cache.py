"""The native device expert cache: slots on a device, filled and emptied by the residency
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
    """One device's slot cache: the manager's (inline) Transport for its device, and a
    RouteObserver.

    The manager decides at once (an admitted expert is resident from its admission on); this
    class moves the bytes: ``drop`` clears a victim's table entry and frees its slot (or
    cancels its copy still in flight), ``submit`` copies the new expert into a free slot of
    its pool on a worker thread. A finished copy is published (table entry set) at a safe
    point; until then the graph computes that expert cold, which changes speed, never the
    result or the manager's decisions. A copy that fails tells the manager
    (``transfer_failed``): the expert leaves the device, its victims stay evicted.
    """

    inline = True

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
        # key -> (ticket, slot, its copy) while the copy runs or waits to be published
        self._jobs: dict[ExpertKey, tuple[Ticket, int, Future]] = {}
        self._cancelled: list[tuple[int, int, Future]] = []   # (pool, slot, copy) of dropped keys
        self._pool = ThreadPoolExecutor(max(workers, 4), thread_name_prefix=f"slots-{device}")
        self._held: LayerAccess | None = None
        self.copies = self.copy_failures = self.refused = 0
        self.copied_bytes = 0

    # -- Transport ---------------------------------------------------------------------------
    def bind(self, manager) -> None:
        self.manager = manager

    def submit(self, ticket: Ticket) -> None:
        slot = self._claim_slot(ticket.key.layer)
        if slot is None:                     # no slot of this layer's layout: stays cold
            self.refused += 1
            self.manager.transfer_failed(ticket)
            return
        self._jobs[ticket.key] = (ticket, slot, self._pool.submit(self._copy, ticket, slot))

    def drop(self, device: str, key: ExpertKey) -> None:
        slot = self.slot_of.pop(key, None)
        if slot is not None:
            self.cache.table_set(key.layer, key.expert, -1)
            self.free[self.pool_of_layer[key.layer]].append(slot)
        job = self._jobs.pop(key, None)
        if job is not None:                  # its copy still runs: the slot frees after it
            self._cancelled.append((self.pool_of_layer[key.layer], job[1], job[2]))

    def _claim_slot(self, layer: int) -> int | None:
        pool = self.pool_of_layer[layer] if 0 <= layer < len(self.pool_of_layer) else -1
        if pool < 0:
            return None
        if not self.free[pool]:              # a dropped key's copy still holds a slot
            for entry in [c for c in self._cancelled if c[0] == pool]:
                wait([entry[2]])          # a failed copy frees its slot too
                self._cancelled.remove(entry)
                self.free[pool].append(entry[1])
                break
        return self.free[pool].pop() if self.free[pool] else None

    def _copy(self, ticket: Ticket, slot: int) -> None:
        """Worker thread: the expert's bytes into ``slot`` (the shim call releases the GIL)."""
        key = ticket.key
        for proj, offset, stride in self.source.parts[key.layer]:
            self.cache.slot_set(key.layer, slot, proj, self.source.base + offset
                                + key.expert * stride, stride)

    def publish(self) -> int:
        """At a safe point: finished copies enter the tables. Returns how many."""
        published = 0
        for entry in [c for c in self._cancelled if c[2].done()]:
            self._cancelled.remove(entry)
            self.free[entry[0]].append(entry[1])
        for key, (ticket, slot, fut) in list(self._jobs.items()):
            if not fut.done():
                continue
            del self._jobs[key]
            error = fut.exception()
            if error is not None:
                self.copy_failures += 1
                self.free[self.pool_of_layer[key.layer]].append(slot)
                self.manager.transfer_failed(ticket)
                notice(f"{self.device}: an expert copy failed ({error}); it stays cold")
                continue
            self.cache.table_set(key.layer, key.expert, slot)
            self.slot_of[key] = slot
            self.copies += 1
            self.copied_bytes += ticket.bytes
            published += 1
        return published

    def settle(self) -> None:
        """Wait for every copy in flight, then publish: tables and manager agree after it."""
        futures = [job[2] for job in self._jobs.values()] + [c[2] for c in self._cancelled]
        if futures:
            wait(futures)
        self.publish()

    def wait_copies(self, tickets) -> None:
        """Block until the copies of ``tickets`` (submitted here) are done, then publish."""
        futures = [job[2] for t in tickets if (job := self._jobs.get(t.key)) is not None]
        if futures:
            wait(futures)
        self.publish()

    # -- RouteObserver ------------------------------------------------------------------------
    def on_route(self, event) -> None:
        self.publish()
        held, self._held = self._held, None
        access = self.manager.access_layer(self.device, event.layer, event.experts.reshape(-1),
                                           event.phase, release=held)
        self._held = access
        if access.tickets and self.wait_in_prefill and event.phase != Phase.DECODE:
            self.wait_copies(access.tickets)

    def on_batch_end(self, phase: Phase, n_tokens: int) -> None:
        # copies started in a batch complete before the next batch's decisions: the tables
        # hold exactly the manager's resident set between batches
        self.settle()
        held, self._held = self._held, None
        if held is not None:
            self.manager.release(held)

    # -- lifetime ------------------------------------------------------------------------------
    def resident(self) -> dict[ExpertKey, int]:
        """A copy of expert -> slot for what is resident (published) now."""
        return dict(self.slot_of)

    def pools(self) -> list:
        """The manager's pools for this cache: one per layout that has slots (capacity = its
        slots' bytes; the sinks are not charged), plus one of capacity 0 for layers whose
        layout got no slot."""
        from runtime.residency.manager import PoolSpec  # noqa: PLC0415

        out = []
        by_pool: dict[int, list[int]] = {}
        for layer, pool in enumerate(self.pool_of_layer):
            if pool >= 0:
                by_pool.setdefault(pool, []).append(layer)
        moe = set(self.manager.moe_layers)
        for pool in sorted(by_pool):
            n_slots, slot_bytes = self.cache.pool_info(pool)
            out.append(PoolSpec(tuple(by_pool[pool]), n_slots * slot_bytes))
        covered = {layer for layers in by_pool.values() for layer in layers}
        none = sorted(moe - covered)
        if none:
            out.append(PoolSpec(tuple(none), 0))
        return out

    def close(self) -> None:
        """Finish the copies in flight, then free the slots (before the model is freed)."""
        if self.cache.handle is None:
            return
        self._pool.shutdown(wait=True)
        self.publish()
        if self._held is not None:
            self.manager.release(self._held)
            self._held = None
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
        notice(f"{', '.join(devices)}: the device expert cache needs the patched llama.cpp "
               "(`moe-offload native build`, then EngineSettings.lib_dir / LLAMA_CPP_LIB_PATH); "
               "running on the stock libraries, where these devices are bookkeeping only")
        return None
    reason = check_same_libllama(lib_dir)
    if reason:
        notice(f"device expert cache off: {reason}")
        return None
    from gguf_tools.expert_index import ExpertIndex  # noqa: PLC0415
    from runtime.residency.transport import claim_device  # noqa: PLC0415

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
        source = ExpertSource(engine.settings.model_path, index)
        cache = DeviceCache(manager, device, shim_cache, source)
        # the cache's pools (one per expert layout, its slots' bytes: the sinks live inside
        # the budget but are never charged) become the manager's, per pool
        manager.set_pools(device, cache.pools())
        claim_device(manager, device, cache)
        engine.add_route_observer(cache)
        caches.append(cache)
    return DeviceCaches(caches) if caches else None
