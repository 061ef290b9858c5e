"""The patched llama.cpp with a persistent per-expert device cache (see native/ and
docs/design/contracts.md, "Native").

    moe-offload native build [--backend cpu|cuda|vulkan]   # build.py
    moe-offload native status [--json]                     # status.py
    runtime.native.device_cache.attach(engine)             # the engine calls it

``preferred_lib_dir(devices)`` is what an engine about to load llama.cpp should pass as
``EngineSettings.lib_dir`` when its residency config has a cache device: the current build for
that device's backend, or None (then the stock libraries run and the cache says so once).
"""
from __future__ import annotations

from collections.abc import Iterable


def preferred_lib_dir(devices: Iterable[str]) -> str | None:
    """The lib dir of the current build serving ``devices`` (cuda:N needs a cuda build,
    vulkan:N a vulkan one; cpu-slots takes a cpu build, else any); None when there is none or
    no cache device."""
    from runtime.native.build import find_build  # noqa: PLC0415

    devices = set(devices)
    if any(d.startswith("cuda:") for d in devices):
        build = find_build("cuda")
    elif any(d.startswith("vulkan:") for d in devices):
        build = find_build("vulkan")
    elif "cpu-slots" in devices:
        build = find_build("cpu") or find_build()
    else:
        return None
    return build.lib_dir if build is not None else None
