"""cffi (ABI mode) access to the device cache store (llamacpp/device_cache/device_cache_store.h:
the device cache's slots and tables in llama.cpp, ``dc_store_*``) of a native build.

    lib = load_store(lib_dir)                   # the build's libmoe_device_cache.so
    store = DeviceCacheStore.create(lib, model_ptr, "CPU", capacity_bytes, max_tokens=512)
    pool, expert_bytes = store.layer_info(3)
    store.slot_load(3, expert=17, slot=0); store.table_set(3, 17, 0)
    store.close()

The store links the libllama of its own directory by soname; load it only into a process whose
llama-cpp-python bindings loaded that same directory (``LLAMA_CPP_LIB_PATH``), or the slot
registry lives in a second, unused copy of libllama (``check_same_libllama``).
"""
from __future__ import annotations

import os
import re
from pathlib import Path

from cffi import FFI

from runtime.native.build import STORE_DIR, STORE_HEADER, STORE_LIB

STATUS_NAMES = {0: "ok", 1: "bad argument", 2: "no such ggml device", 3: "allocation failed",
                4: "no MoE layer the cache can serve", 5: "expert tensors not in host memory",
                6: "libllama refused the registration (not the patched build?)"}
PROJ_UP, PROJ_GATE, PROJ_DOWN, PROJ_GATE_UP = 0, 1, 2, 3
PROJ_BY_TENSOR = {"ffn_up_exps": PROJ_UP, "ffn_gate_exps": PROJ_GATE, "ffn_down_exps": PROJ_DOWN,
                  "ffn_gate_up_exps": PROJ_GATE_UP}

_ffi: FFI | None = None
_libs: dict[str, object] = {}


class DeviceCacheError(RuntimeError):
    """A device cache store call returned an error status (or the cache could not start)."""


def ffi() -> FFI:
    """The FFI with the declarations of device_cache_store.h (preprocessor lines dropped)."""
    global _ffi
    if _ffi is None:
        text = (STORE_DIR / STORE_HEADER).read_text()
        text = re.sub(r"//[^\n]*", "", text)
        keep = [ln for ln in text.splitlines()
                if not ln.lstrip().startswith("#") and 'extern "C"' not in ln and ln.strip() != "}"]
        f = FFI()
        f.cdef("\n".join(keep))
        _ffi = f
    return _ffi


def load_store(lib_dir: str | os.PathLike[str]):
    """dlopen ``lib_dir/libmoe_device_cache.so`` (once per directory)."""
    path = str(Path(lib_dir) / STORE_LIB)
    if path not in _libs:
        _libs[path] = ffi().dlopen(path)
    return _libs[path]


def check(rc: int, what: str) -> None:
    if rc != 0:
        raise DeviceCacheError(f"{what}: {STATUS_NAMES.get(rc, f'status {rc}')}")


class DeviceCacheStore:
    """One ``dc_store_t``: thin, checked wrappers; the policy lives in the residency manager."""

    def __init__(self, lib, handle):
        self.lib, self.handle = lib, handle
        f = ffi()
        n_layer, n_pool = f.new("int32_t *"), f.new("int32_t *")
        check(lib.dc_store_counts(handle, n_layer, n_pool), "dc_store_counts")
        self.n_layer, self.n_pool = int(n_layer[0]), int(n_pool[0])

    @classmethod
    def create(cls, lib, model_ptr: int, device: str, capacity_bytes: int, *,
               max_tokens: int) -> DeviceCacheStore:
        """``max_tokens``: the context's n_ubatch (larger ubatches compute without the cache)."""
        f = ffi()
        out = f.new("dc_store_t *")
        rc = lib.dc_store_create(f.cast("struct llama_model *", model_ptr), device.encode(),
                                 int(capacity_bytes), int(max_tokens), out)
        check(rc, f"dc_store_create({device}, {capacity_bytes} bytes)")
        return cls(lib, out[0])

    def close(self) -> None:
        if self.handle is not None:
            self.lib.dc_store_free(self.handle)
            self.handle = None

    def layer_info(self, layer: int) -> tuple[int, int]:
        """(pool or -1, bytes of one expert of the layer)."""
        f = ffi()
        pool, nbytes = f.new("int32_t *"), f.new("size_t *")
        check(self.lib.dc_store_layer_info(self.handle, layer, pool, nbytes), "dc_store_layer_info")
        return int(pool[0]), int(nbytes[0])

    def pool_info(self, pool: int) -> tuple[int, int]:
        """(slots, bytes of one slot)."""
        f = ffi()
        n, nbytes = f.new("int32_t *"), f.new("size_t *")
        check(self.lib.dc_store_pool_info(self.handle, pool, n, nbytes), "dc_store_pool_info")
        return int(n[0]), int(nbytes[0])

    def proj_bytes(self, layer: int, proj: int) -> int:
        out = ffi().new("size_t *")
        check(self.lib.dc_store_proj_bytes(self.handle, layer, proj, out), "dc_store_proj_bytes")
        return int(out[0])

    def allocated_bytes(self) -> int:
        out = ffi().new("size_t *")
        check(self.lib.dc_store_allocated_bytes(self.handle, out), "dc_store_allocated_bytes")
        return int(out[0])

    def slot_set(self, layer: int, slot: int, proj: int, src_ptr, nbytes: int) -> None:
        """Copy ``nbytes`` from a cffi pointer into one projection of a slot (GIL released)."""
        check(self.lib.dc_store_slot_set(self.handle, layer, slot, proj, src_ptr, nbytes),
              f"dc_store_slot_set(layer {layer}, slot {slot}, proj {proj})")

    def slot_get(self, layer: int, slot: int, proj: int) -> bytes:
        n = self.proj_bytes(layer, proj)
        buf = ffi().new("char[]", n)
        check(self.lib.dc_store_slot_get(self.handle, layer, slot, proj, buf, n),
              "dc_store_slot_get")
        return bytes(ffi().buffer(buf, n))

    def slot_load(self, layer: int, expert: int, slot: int) -> None:
        check(self.lib.dc_store_slot_load(self.handle, layer, expert, slot),
              f"dc_store_slot_load(layer {layer}, expert {expert}, slot {slot})")

    def table_set(self, layer: int, expert: int, slot: int) -> None:
        check(self.lib.dc_store_table_set(self.handle, layer, expert, slot),
              f"dc_store_table_set(layer {layer}, expert {expert}, slot {slot})")

    def route(self, layer: int, ids) -> None:
        """Write a layer's id planes for routed ``ids`` (n_tokens, n_expert_used) (tests)."""
        import numpy as np  # noqa: PLC0415
        arr = np.ascontiguousarray(ids, dtype=np.int32)
        check(self.lib.dc_store_route(self.handle, layer, ffi().from_buffer("int32_t[]", arr),
                                      arr.shape[0]), f"dc_store_route(layer {layer})")

    @property
    def eval_callback(self):
        """``dc_store_eval`` as a C function pointer (cb_eval; user data: ``self.handle``)."""
        return int(ffi().cast("uintptr_t", self.lib.dc_store_eval))

    def table_get(self, layer: int, expert: int) -> int:
        out = ffi().new("int32_t *")
        check(self.lib.dc_store_table_get(self.handle, layer, expert, out), "dc_store_table_get")
        return int(out[0])


def check_same_libllama(lib_dir: str | os.PathLike[str]) -> str | None:
    """None when this process's libllama is ``lib_dir``'s; otherwise why not (one line)."""
    try:
        import llama_cpp.llama_cpp as ll  # noqa: PLC0415
    except ImportError as exc:
        return f"llama_cpp cannot be imported ({exc})"
    loaded = getattr(getattr(ll, "_lib", None), "_name", None)
    if loaded is None:
        return "cannot tell which libllama llama-cpp-python loaded"
    if Path(loaded).resolve().parent != Path(lib_dir).resolve():
        return (f"llama-cpp-python loaded {loaded}, not the patched build in {lib_dir} "
                f"(set LLAMA_CPP_LIB_PATH / EngineSettings.lib_dir before the first model)")
    return None
