"""Install moe-offload with the one llama.cpp it runs on: ours, patched (llamacpp/patches).

``pip install -e .`` (metadata in pyproject.toml) does two things beyond a plain install:
  * llama-cpp-python 0.3.36's Python bindings (the ``llama_cpp`` package, pure Python) come
    from the repository's source archive (offline/), unpacked into build/bindings/;
    llama-cpp-python's own compile of the stock llama.cpp never runs;
  * the patched llama.cpp is built once (runtime/native/build.py, minutes; cached in
    ~/.cache/moe-offload/native/ by a hash of its sources and options, so a second install,
    another clone or the test suite finds it at once). The backend follows CMAKE_ARGS as
    llama-cpp-python's install does: ``CMAKE_ARGS="-DGGML_CUDA=on" pip install -e .`` builds
    CUDA, ``-DGGML_VULKAN=on`` Vulkan, otherwise the CPU. Progress goes to the terminal (pip
    shows a build's own output only with -v). MOE_OFFLOAD_SKIP_NATIVE_BUILD=1 skips it (the
    first run then says which command builds it).
"""
from __future__ import annotations

import os
import sys
import tarfile
from pathlib import Path

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py

HERE = Path(__file__).resolve().parent
ARCHIVE = HERE / "offline" / "llama-cpp-python-0.3.36-pruned.tar.xz"
BINDINGS = HERE / "build" / "bindings"
PREFIX = "llama_cpp_python-0.3.36/llama_cpp/"
# put before the bindings' __init__: they load libllama at import, from LLAMA_CPP_LIB_PATH or a
# lib/ folder beside them that this install does not have; without the variable, take this
# install's patched build (as every moe-offload command does)
PRELUDE = b"""# moe-offload (setup.py): libllama is this install's patched build unless chosen already
import os as _os
if not _os.environ.get("LLAMA_CPP_LIB_PATH"):
    try:
        from runtime.native import preferred_lib_dir as _lib_dir
        if _lib_dir() is not None:
            _os.environ["LLAMA_CPP_LIB_PATH"] = _lib_dir()
    except ImportError:
        pass
"""


def unpack_bindings() -> None:
    """The ``llama_cpp`` package (pure Python) from the archive into build/bindings/llama_cpp
    (replaced whole: an older unpack never mixes in)."""
    target = BINDINGS / "llama_cpp"
    stamp = BINDINGS / ".archive-size"
    size = f"{ARCHIVE.stat().st_size} {len(PRELUDE)}"
    if target.is_dir() and stamp.is_file() and stamp.read_text() == size:
        return
    tmp = BINDINGS / "llama_cpp.tmp"
    if tmp.exists():
        import shutil
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    with tarfile.open(ARCHIVE) as tar:
        for member in tar:
            if not member.name.startswith(PREFIX) or not member.isfile():
                continue
            rel = member.name[len(PREFIX):]
            if "/" in rel or ".." in rel:
                continue                     # the package's own modules only
            with tar.extractfile(member) as src:
                data = src.read()
            (tmp / rel).write_bytes(PRELUDE + data if rel == "__init__.py" else data)
    if target.exists():
        import shutil
        shutil.rmtree(target)
    tmp.rename(target)
    stamp.write_text(size)


class BuildWithLlama(build_py):
    """build_py, after building the patched llama.cpp (or finding it built)."""

    def run(self) -> None:
        if os.environ.get("MOE_OFFLOAD_SKIP_NATIVE_BUILD", "") not in ("1", "yes", "true"):
            sys.path.insert(0, str(HERE))
            try:
                from runtime.native.install import install_build  # noqa: PLC0415
            finally:
                sys.path.pop(0)
            install_build()
        super().run()


unpack_bindings()
setup(
    packages=find_packages(include=["runtime*", "gguf_tools*"]) + ["llama_cpp"],
    package_dir={"llama_cpp": "build/bindings/llama_cpp"},
    cmdclass={"build_py": BuildWithLlama},
)
