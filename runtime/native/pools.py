"""The device cache's pools (layers that share an expert layout, and the slots each gets) as
the residency manager's pools, and a way to ask for them without running a model.

    pools_of(store, moe_layers)      -> [PoolSpec, ...]      # what DeviceCache hands the manager
    probe_pools(model_path, device, capacity) -> PoolProbe   # config check: load, ask, free
"""
from __future__ import annotations

from dataclasses import dataclass

from runtime.residency.manager import PoolSpec

_GGML_NAMES = {"cuda": "CUDA", "vulkan": "Vulkan"}


def ggml_device_name(device: str) -> str:
    """Residency device -> ggml device name: "cpu-slots" -> "CPU", "cuda:1" -> "CUDA1",
    "vulkan:0" -> "Vulkan0"."""
    if device == "cpu-slots":
        return "CPU"
    kind, _, index = device.partition(":")
    if kind in _GGML_NAMES and index.isdigit():
        return f"{_GGML_NAMES[kind]}{int(index)}"
    raise ValueError(f"{device}: not a device the device cache serves (cuda:N, vulkan:N, "
                     "cpu-slots)")


@dataclass(frozen=True)
class PoolInfo:
    """One pool as the cache allocated it."""

    layers: tuple[int, ...]
    slots: int              # assignable slots (the sinks not counted)
    slot_bytes: int         # bytes of one slot (all projections of one expert)

    @property
    def capacity_bytes(self) -> int:
        return self.slots * self.slot_bytes


def pool_infos(store, moe_layers) -> list[PoolInfo]:
    """The store's pools with slots, then one of 0 slots for MoE layers whose layout got none."""
    by_pool: dict[int, list[int]] = {}
    for layer in range(store.n_layer):
        pool, _ = store.layer_info(layer)
        if pool >= 0:
            by_pool.setdefault(pool, []).append(layer)
    out = []
    for pool in sorted(by_pool):
        n_slots, slot_bytes = store.pool_info(pool)
        out.append(PoolInfo(tuple(by_pool[pool]), n_slots, slot_bytes))
    covered = {layer for layers in by_pool.values() for layer in layers}
    rest = tuple(sorted(set(moe_layers) - covered))
    if rest:
        out.append(PoolInfo(rest, 0, 0))
    return out


def pools_of(store, moe_layers) -> list[PoolSpec]:
    """The manager's pools for a device cache store: capacity = slots x slot bytes (the sinks
    live inside the budget but are never charged)."""
    return [PoolSpec(p.layers, p.capacity_bytes) for p in pool_infos(store, moe_layers)]


@dataclass(frozen=True)
class PoolProbe:
    pools: tuple[PoolInfo, ...]
    why_not: str = ""        # set when the pools could not be known here


def probe_pools(model_path: str, device: str, capacity: int, moe_layers) -> PoolProbe:
    """Load the model (mapped, nothing computed) with the patched library, let the cache
    allocate ``capacity`` bytes on ``device``, read its pools, free everything. Must run in a
    process that has not loaded llama.cpp yet (``config check``)."""
    from runtime.native import llama_lib  # noqa: PLC0415
    from runtime.native import preferred_lib_dir  # noqa: PLC0415
    from runtime.native.device_cache_store import (  # noqa: PLC0415
        DeviceCacheError, DeviceCacheStore, load_store)

    lib_dir = preferred_lib_dir({device})
    if lib_dir is None:
        return PoolProbe((), "no native build here (`moe-offload native build`); the cache "
                             "reports its pools at load")
    try:
        llama_lib.select_library_dir(lib_dir)
    except RuntimeError as exc:
        return PoolProbe((), str(exc))
    ll = llama_lib.bindings()
    llama_lib.set_logging(False)
    try:
        model = llama_lib.load_model(model_path, n_gpu_layers=0, repack=False)
    except RuntimeError as exc:
        return PoolProbe((), f"the model did not load ({exc})")
    try:
        try:
            store = DeviceCacheStore.create(load_store(lib_dir), model,
                                            ggml_device_name(device), capacity, max_tokens=1)
        except DeviceCacheError as exc:
            return PoolProbe((), f"the cache could not be made here ({exc})")
        try:
            return PoolProbe(tuple(pool_infos(store, moe_layers)))
        finally:
            store.close()
    finally:
        ll.llama_model_free(model)
