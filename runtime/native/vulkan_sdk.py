"""The Vulkan headers and shader compiler a ``--backend vulkan`` build needs.

This llama.cpp's Vulkan backend uses ``VK_EXT_layer_settings`` (Vulkan headers 1.3.261+) and
SPIRV-Headers' CMake package. Debian 12 ships 1.3.239, so ``scripts/vulkan_toolchain.sh``
unpacks newer header packages (no libraries) into ``<cache>/vulkan-sdk/usr``; a build uses that
prefix when it is there (``CPATH``, ``CMAKE_PREFIX_PATH``), else the system's headers. Either
way the headers are checked before CMake runs, so a machine without them gets one line that
says what to do, not a compile error minutes later.
"""
from __future__ import annotations

import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

from runtime.cache import cache_dir
from runtime.errors import UserError

_NEEDED = "LayerSettingEXT"                   # vk::LayerSettingEXT, VK_EXT_layer_settings
_HINT = "run scripts/vulkan_toolchain.sh (Debian: installs glslc and lavapipe, unpacks headers)"


def sdk_prefix() -> Path:
    """Where scripts/vulkan_toolchain.sh unpacks the newer headers."""
    return cache_dir("vulkan-sdk", "usr")


@dataclass(frozen=True)
class VulkanHeaders:
    """The headers a build uses: ``prefix`` (None: the system's) and their version."""

    prefix: Path | None
    version: str

    def fingerprint(self) -> str:
        return f"vulkan-headers {self.version} {self.prefix or 'system'}"

    def apply(self, env: dict[str, str]) -> dict[str, str]:
        """``env`` with this prefix searched first (compiler includes, CMake packages)."""
        if self.prefix is None:
            return env
        env = dict(env)
        for var, path in (("CPATH", self.prefix / "include"), ("CMAKE_PREFIX_PATH", self.prefix)):
            env[var] = os.pathsep.join(p for p in (str(path), env.get(var, "")) if p)
        return env


def _version(include: Path) -> str | None:
    """VK_HEADER_VERSION_COMPLETE of the headers under ``include`` when they are new enough."""
    structs = include / "vulkan" / "vulkan_structs.hpp"
    core = include / "vulkan" / "vulkan_core.h"
    try:
        if _NEEDED not in structs.read_text(errors="replace"):
            return None
        text = core.read_text(errors="replace")
    except OSError:
        return None
    m = re.search(r"#define VK_HEADER_VERSION_COMPLETE VK_MAKE_API_VERSION\(0, (\d+), (\d+), "
                  r"VK_HEADER_VERSION\)", text)
    n = re.search(r"#define VK_HEADER_VERSION (\d+)", text)
    return f"{m.group(1)}.{m.group(2)}.{n.group(1)}" if m and n else "unknown"


def resolve() -> VulkanHeaders:
    """The headers to build with, or UserError saying what is missing."""
    if shutil.which("glslc") is None:
        raise UserError(f"--backend vulkan: glslc (the shader compiler) is not on PATH; {_HINT}")
    prefix = sdk_prefix()
    for root, found in ((prefix, prefix), (Path("/usr"), None)):
        version = _version(root / "include")
        if version is None:
            continue
        if not any((r / "share" / "cmake" / "SPIRV-Headers" / "SPIRV-HeadersConfig.cmake").is_file()
                   for r in (root, Path("/usr"))):
            raise UserError(f"--backend vulkan: SPIRV-Headers' CMake package is missing; {_HINT}")
        return VulkanHeaders(found, version)
    raise UserError(f"--backend vulkan: no Vulkan headers with {_NEEDED} (1.3.261+) in "
                    f"{prefix / 'include'} or /usr/include; {_HINT}")
