"""The patched llama.cpp: the one llama.cpp every path runs on (see native/ and
docs/design/contracts.md, "Native").

    pip install -e .                                       # builds it (install.py)
    moe-offload native build [--backend cpu|cuda|vulkan]   # build.py
    moe-offload native status [--json]                     # status.py
    runtime.native.device_cache.attach(engine)             # the engine calls it

``lib_dir_for(devices)`` is the libllama directory a process about to load llama.cpp uses:
$LLAMA_CPP_LIB_PATH when set, a CUDA (Vulkan) build for a cuda:N (vulkan:N) device, else this
install's build; a UserError (install.NativeBuildMissing, exit 1) saying which command builds
it when there is none.
``preferred_lib_dir(devices)`` is the same without the error (None), for probes.
"""
from __future__ import annotations

import os
from collections.abc import Iterable

LIB_PATH_ENV = "LLAMA_CPP_LIB_PATH"


def _backend_for(devices: set[str]) -> str | None:
    if any(d.startswith("cuda:") for d in devices):
        return "cuda"
    if any(d.startswith("vulkan:") for d in devices):
        return "vulkan"
    return None


def preferred_lib_dir(devices: Iterable[str] = ()) -> str | None:
    """The lib dir of the current build serving ``devices`` (cuda:N needs a cuda build,
    vulkan:N a vulkan one; anything else this install's build); None when there is none."""
    from runtime.native.build import find_build  # noqa: PLC0415
    from runtime.native.install import default_build  # noqa: PLC0415

    backend = _backend_for(set(devices))
    build = find_build(backend) if backend is not None else default_build()
    return build.lib_dir if build is not None else None


def lib_dir_for(devices: Iterable[str] = ()) -> str:
    """$LLAMA_CPP_LIB_PATH when set, else ``preferred_lib_dir(devices)``; UserError (one
    line: the command that builds it) when no current build serves them."""
    from runtime.native.install import NativeBuildMissing, missing_message  # noqa: PLC0415

    env = os.environ.get(LIB_PATH_ENV)
    if env:
        return env
    devices = set(devices)
    found = preferred_lib_dir(devices)
    if found is None:
        raise NativeBuildMissing(missing_message(_backend_for(devices)))
    return found
