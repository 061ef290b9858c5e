"""The RPC backend of our patched build, through ctypes: remote devices for llama.cpp, their
failure state, and the server loop.

Opened BY SONAME after libllama is loaded (see runtime/native/ggml_lib.py): the same copy of
ggml's registry libllama uses. Only a build made with ``native build --rpc`` has it.
"""
from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass

from runtime.errors import UserError

TIMEOUT_ENV = "GGML_RPC_TIMEOUT_S"          # read by patch 0004 when a connection is made
DEFAULT_TIMEOUT_S = 20.0                     # any send / receive on a link: then it is down


@dataclass(frozen=True)
class RemoteHandle:
    """A remote device registered with ggml: its ``ggml_backend_dev_t`` and ggml's name."""

    device: str          # rpc:host:port[/N]
    endpoint: str        # host:port
    handle: int          # ggml_backend_dev_t
    ggml_name: str       # "RPC0", "RPC1", ...


# name -> (restype, argtypes) of ggml-rpc's functions (ggml-rpc.h, with patch 0004's)
_RPC = {
    "ggml_backend_rpc_add_server": (ctypes.c_void_p, [ctypes.c_char_p]),
    "ggml_backend_rpc_failure_count": (ctypes.c_uint64, []),
    "ggml_backend_rpc_endpoint_failed": (ctypes.c_bool, [ctypes.c_char_p]),
    "ggml_backend_rpc_start_server": (None, [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_size_t,
                                             ctypes.c_size_t, ctypes.c_void_p]),
}


class _RpcLib:
    def __init__(self) -> None:
        from runtime.native import ggml_lib  # noqa: PLC0415

        ggml_lib.ggml()                      # libllama (and its ggml) first
        try:
            lib = ctypes.CDLL("libggml-rpc.so.0")
        except OSError:
            try:
                lib = ctypes.CDLL("libggml-rpc.so")
            except OSError:
                raise UserError("this llama.cpp has no RPC backend: build one with "
                                "`moe-offload native build --rpc`") from None
        if not hasattr(lib, "ggml_backend_rpc_failure_count"):
            raise UserError("this llama.cpp's RPC backend lacks moe-offload's patch 0004 "
                            "(a lost connection would abort the process): rebuild with "
                            "`moe-offload native build --rpc`")
        self.lib = lib
        ggml_lib.declare(lib, _RPC)
        handles = ggml_lib.ggml()             # the registry libllama uses, declared once there
        self.reg, self.base = handles.reg, handles.base
        self._registered: dict[str, list[int]] = {}    # endpoint -> device handles


_lib: _RpcLib | None = None


def rpc_lib() -> _RpcLib:
    global _lib
    if _lib is None:
        _lib = _RpcLib()
    return _lib


def set_link_timeout(seconds: float | None = None) -> float:
    """Bound every send/receive of the links made from now on (patch 0004 reads the env)."""
    value = seconds if seconds is not None else float(os.environ.get(
        "MOE_OFFLOAD_RPC_TIMEOUT_S", DEFAULT_TIMEOUT_S))
    os.environ[TIMEOUT_ENV] = f"{value:g}"
    return value


def add_remote(device: str, endpoint: str, index: int) -> RemoteHandle:
    """Register ``endpoint``'s devices with ggml (once per endpoint) and return device
    ``index``. Probe the remote first (runtime.rpc.probe): ggml-rpc's connect has no timeout."""
    lib = rpc_lib()
    handles = lib._registered.get(endpoint)
    if handles is None:
        reg = lib.lib.ggml_backend_rpc_add_server(endpoint.encode())
        if not reg:
            raise UserError(f"{device}: ggml-rpc could not connect to {endpoint}")
        lib.reg.ggml_backend_register(reg)
        handles = [int(lib.base.ggml_backend_reg_dev_get(reg, i))
                   for i in range(lib.base.ggml_backend_reg_dev_count(reg))]
        lib._registered[endpoint] = handles
    if index >= len(handles):
        raise UserError(f"{device}: {endpoint} offers {len(handles)} device(s), not device {index}")
    h = handles[index]
    return RemoteHandle(device, endpoint, h, lib.base.ggml_backend_dev_name(h).decode())


def failure_count() -> int:
    """Connections lost in this process so far (0 without the RPC library loaded)."""
    return int(_lib.lib.ggml_backend_rpc_failure_count()) if _lib is not None else 0


def endpoint_failed(endpoint: str) -> bool:
    return bool(_lib is not None and _lib.lib.ggml_backend_rpc_endpoint_failed(endpoint.encode()))


def local_device(name: str) -> int:
    """A local ggml device for the server to offer: "cpu", or "cuda:N" / "vulkan:N"."""
    lib = rpc_lib()
    if name == "cpu":
        dev = lib.reg.ggml_backend_dev_by_type(0)        # GGML_BACKEND_DEVICE_TYPE_CPU
    else:
        kind, _, idx = name.partition(":")
        ggml_name = {"cuda": "CUDA", "vulkan": "Vulkan"}.get(kind)
        if ggml_name is None or not idx.isdigit():
            raise UserError(f"--device {name}: unknown (cpu, cuda:N, vulkan:N)")
        dev = lib.reg.ggml_backend_dev_by_name(f"{ggml_name}{idx}".encode())
    if not dev:
        raise UserError(f"--device {name}: this build has no such device")
    return int(dev)


def device_memory(handle: int) -> tuple[int, int]:
    free, total = ctypes.c_size_t(0), ctypes.c_size_t(0)
    rpc_lib().base.ggml_backend_dev_memory(handle, ctypes.byref(free), ctypes.byref(total))
    return int(free.value), int(total.value)


def device_description(handle: int) -> str:
    lib = rpc_lib()
    return (f"{lib.base.ggml_backend_dev_name(handle).decode()} "
            f"({lib.base.ggml_backend_dev_description(handle).decode()})")


def serve_forever(endpoint: str, cache_dir: str | None, n_threads: int, device: int) -> None:
    """``ggml_backend_rpc_start_server``: blocks (accepting one client at a time)."""
    devices = (ctypes.c_void_p * 1)(device)
    rpc_lib().lib.ggml_backend_rpc_start_server(
        endpoint.encode(), cache_dir.encode() if cache_dir else None, n_threads, 1,
        ctypes.cast(devices, ctypes.c_void_p))
