"""The Vulkan header check a --backend vulkan build runs before CMake: which headers it takes,
what it puts on the build's paths, and the one-line errors when something is missing."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from runtime.errors import UserError
from runtime.native import vulkan_sdk
from runtime.native.build import BuildRequest, build

CORE = """#define VK_HEADER_VERSION 309
#define VK_HEADER_VERSION_COMPLETE VK_MAKE_API_VERSION(0, 1, 4, VK_HEADER_VERSION)
"""


def _fake_sdk(root: Path, *, new_enough: bool = True) -> Path:
    usr = root / "vulkan-sdk" / "usr"
    (usr / "include" / "vulkan").mkdir(parents=True)
    (usr / "include" / "vulkan" / "vulkan_core.h").write_text(CORE)
    (usr / "include" / "vulkan" / "vulkan_structs.hpp").write_text(
        "struct LayerSettingEXT {};\n" if new_enough else "struct Other {};\n")
    cmake = usr / "share" / "cmake" / "SPIRV-Headers"
    cmake.mkdir(parents=True)
    (cmake / "SPIRV-HeadersConfig.cmake").write_text("")
    return usr


@pytest.fixture
def with_glslc(tmp_path, monkeypatch):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    glslc = bin_dir / "glslc"
    glslc.write_text("#!/bin/sh\n")
    glslc.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("MOE_OFFLOAD_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_the_cached_headers_come_first(with_glslc):
    usr = _fake_sdk(with_glslc)
    headers = vulkan_sdk.resolve()
    assert headers.prefix == usr and headers.version == "1.4.309"
    env = headers.apply({"CPATH": "/x", "PATH": "/bin"})
    assert env["CPATH"] == f"{usr / 'include'}{os.pathsep}/x"
    assert env["CMAKE_PREFIX_PATH"] == str(usr) and env["PATH"] == "/bin"
    assert "1.4.309" in headers.fingerprint()


def test_old_headers_are_refused_before_cmake(with_glslc):
    _fake_sdk(with_glslc, new_enough=False)
    if vulkan_sdk._version(Path("/usr/include")) is not None:
        pytest.skip("this machine's own headers are new enough")
    with pytest.raises(UserError, match="LayerSettingEXT.*vulkan_toolchain.sh"):
        vulkan_sdk.resolve()


def test_no_glslc_is_one_line(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))           # nothing on it
    with pytest.raises(UserError, match="glslc") as err:
        build(BuildRequest(backend="vulkan"))
    assert "\n" not in str(err.value)
