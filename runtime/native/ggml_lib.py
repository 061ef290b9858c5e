"""ggml's libraries (ggml-base, ggml, ggml-cpu), as the engine calls them: the backend devices,
their buffer types, and ggml-cpu's weight-ready hook.

ggml is opened BY SONAME (``libggml-base.so.0``, ``libggml.so.0``): libllama already loaded
those through its RUNPATH, and glibc hands back the same copy for the same soname. Opening
``.../lib/libggml-base.so`` by path would map a second copy (the wheel ships ``.so`` and
``.so.0`` as separate files) with its own CPU buffer-type pointer and statics.

Usage::

    gpus = [d for d in devices() if d.kind != GGML_BACKEND_DEVICE_TYPE_CPU]
    buft = cpu_buffer_type()          # or device_buffer_type(gpus[0])
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass

from runtime.native.llama_lib import bindings

GGML_BACKEND_DEVICE_TYPE_CPU = 0
GGML_BACKEND_DEVICE_TYPE_GPU = 1
GGML_BACKEND_DEVICE_TYPE_ACCEL = 2
GGML_BACKEND_DEVICE_TYPE_IGPU = 3


@dataclass(frozen=True)
class BackendDevice:
    """One ggml backend device as the registry reports it."""

    index: int
    name: str            # e.g. "CPU", "CUDA0"
    kind: int            # GGML_BACKEND_DEVICE_TYPE_*
    free_bytes: int
    total_bytes: int
    handle: int          # ggml_backend_dev_t


_P, _SIZE = ctypes.c_void_p, ctypes.c_size_t
# name -> (restype, argtypes) of the ggml functions the engine calls (ggml-backend.h, ggml.h)
_GGML_BASE = {
    "ggml_backend_tensor_get": (None, [_P, _P, _SIZE, _SIZE]),
    "ggml_nbytes": (_SIZE, [_P]),
    "ggml_get_name": (_P, [_P]),
    "ggml_backend_cpu_buffer_type": (_P, []),
    "ggml_backend_dev_buffer_type": (_P, [_P]),
    "ggml_backend_dev_name": (ctypes.c_char_p, [_P]),
    "ggml_backend_dev_type": (ctypes.c_int, [_P]),
    "ggml_backend_dev_memory": (None, [_P, ctypes.POINTER(_SIZE), ctypes.POINTER(_SIZE)]),
    "ggml_backend_buft_name": (ctypes.c_char_p, [_P]),
    "ggml_backend_buffer_get_type": (_P, [_P]),
    "ggml_backend_reg_dev_count": (_SIZE, [_P]),
    "ggml_backend_reg_dev_get": (_P, [_P, _SIZE]),
    "ggml_backend_dev_description": (ctypes.c_char_p, [_P]),
}
_GGML_REG = {
    "ggml_backend_dev_count": (_SIZE, []),
    "ggml_backend_dev_get": (_P, [_SIZE]),
    # the device registry calls of remote devices (runtime/rpc/backend.py)
    "ggml_backend_register": (None, [_P]),
    "ggml_backend_dev_by_name": (_P, [ctypes.c_char_p]),
    "ggml_backend_dev_by_type": (_P, [ctypes.c_int]),
}


def declare(lib: ctypes.CDLL, signatures: dict[str, tuple[object, list]]) -> None:
    """Give each of ``lib``'s functions named in ``signatures`` its ctypes signature,
    ``name -> (restype, argtypes)``: the one way a library is declared here (ggml's below,
    ggml-rpc's in runtime/rpc/backend.py)."""
    for name, (restype, argtypes) in signatures.items():
        function = getattr(lib, name)
        function.restype, function.argtypes = restype, argtypes


class _Ggml:
    """ggml functions the engine calls, from the libraries libllama already loaded."""

    def __init__(self) -> None:
        bindings()  # loads libllama, which pulls libggml*.so.0 by soname
        base = ctypes.CDLL("libggml-base.so.0")
        reg = ctypes.CDLL("libggml.so.0")
        self.base, self.reg = base, reg
        declare(base, _GGML_BASE)
        declare(reg, _GGML_REG)


_ggml: _Ggml | None = None


def ggml() -> _Ggml:
    """The ggml handles (opened by soname after libllama is loaded)."""
    global _ggml
    if _ggml is None:
        _ggml = _Ggml()
    return _ggml


def set_weight_ready(pointer: int) -> bool:
    """Install ``pointer`` (a C ``ggml_cpu_weight_ready_t``: the RAM tier's rt_weight_ready)
    as ggml-cpu's weight-ready hook (llamacpp/patches/0007: MUL_MAT_ID computes the experts
    whose bytes are in first and waits for the others); False when this libggml-cpu has no
    such hook."""
    ggml()
    try:
        cpu = ctypes.CDLL("libggml-cpu.so.0")
        setter = cpu.ggml_cpu_set_weight_ready
    except (OSError, AttributeError):
        return False
    setter.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
    setter.restype = None
    setter(pointer, None)
    return True


# -- devices and buffer types --------------------------------------------------------------

def devices() -> list[BackendDevice]:
    """Every device the ggml registry knows (CPU always; GPUs when the build has them)."""
    g = ggml()
    out = []
    for i in range(g.reg.ggml_backend_dev_count()):
        dev = g.reg.ggml_backend_dev_get(i)
        free, total = ctypes.c_size_t(0), ctypes.c_size_t(0)
        g.base.ggml_backend_dev_memory(dev, ctypes.byref(free), ctypes.byref(total))
        out.append(BackendDevice(index=i, name=g.base.ggml_backend_dev_name(dev).decode(),
                                 kind=int(g.base.ggml_backend_dev_type(dev)),
                                 free_bytes=int(free.value), total_bytes=int(total.value),
                                 handle=int(dev)))
    return out


def cpu_buffer_type() -> int:
    """The plain CPU buffer type (the one llama.cpp treats as "override to CPU")."""
    return int(ggml().base.ggml_backend_cpu_buffer_type())


def device_buffer_type(device: BackendDevice) -> int:
    """A device's default buffer type."""
    return int(ggml().base.ggml_backend_dev_buffer_type(device.handle))


def buffer_type_name(buft: int) -> str:
    return ggml().base.ggml_backend_buft_name(buft).decode()
