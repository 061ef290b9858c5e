"""The one llama.cpp: which patched build this install runs on, built at install time.

``pip install -e .`` calls ``install_build()`` (setup.py): the backend comes from CMAKE_ARGS as
with llama-cpp-python (``-DGGML_CUDA=on``: cuda, ``-DGGML_VULKAN=on``: vulkan, else cpu; the
other entries are passed to CMake after ours), the build lands in the cache (build.py) and the
choice is recorded (``installed.json`` beside the builds), so every path afterwards loads that
build: ``default_build()``. A process that needs the library and finds none current (a fresh
checkout whose install skipped the build, or patches changed by a pull) gets one line saying
which command builds it (``missing_message``).

Standard library only: setup.py imports this in pip's build environment.
"""
from __future__ import annotations

import json
import os
import shlex
import sys

from runtime.errors import UserError
from runtime.native.build import BACKENDS, BuildInfo, BuildRequest, build, find_build
from runtime.native.source import cache_root

RECORD = "installed.json"
# CMAKE_ARGS switches that pick a backend, as llama-cpp-python's users write them
_SWITCHES = {"GGML_CUDA": "cuda", "GGML_VULKAN": "vulkan"}
_NOT_OURS = ("GGML_HIP", "GGML_METAL", "GGML_SYCL", "GGML_MUSA", "GGML_CANN", "GGML_OPENCL")


def request_from_cmake_args(text: str | None = None) -> BuildRequest:
    """The build CMAKE_ARGS asks for (``text``; default: the environment's)."""
    text = os.environ.get("CMAKE_ARGS", "") if text is None else text
    backend, extra = "cpu", []
    for arg in shlex.split(text):
        name, _, value = arg[2:].partition("=") if arg.startswith("-D") else ("", "", "")
        name = name.split(":")[0]
        on = value.strip().upper() in ("ON", "1", "TRUE", "YES")
        if name in _SWITCHES:
            if on:
                backend = _SWITCHES[name]
            continue
        if name in _NOT_OURS and on:
            raise UserError(f"CMAKE_ARGS {arg}: moe-offload builds its llama.cpp for "
                            f"{', '.join(BACKENDS)} only")
        extra.append(arg)
    return BuildRequest(backend=backend, extra_cmake_args=tuple(extra))


def installed_backend() -> str:
    """The backend the install chose (``installed.json``), else cpu."""
    try:
        backend = json.loads((cache_root() / RECORD).read_text())["backend"]
    except (OSError, ValueError, KeyError, TypeError):
        return "cpu"
    return backend if backend in BACKENDS else "cpu"


def record_install(info: BuildInfo) -> None:
    root = cache_root()
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / (RECORD + ".tmp")
    tmp.write_text(json.dumps({"backend": info.backend, "key": info.key,
                               "lib_dir": info.lib_dir}, indent=2) + "\n")
    os.replace(tmp, root / RECORD)


def default_build() -> BuildInfo | None:
    """The current build this install runs on: the installed backend's (a CPU one serves
    when that backend has none)."""
    backend = installed_backend()
    return find_build(backend) or (find_build("cpu") if backend != "cpu" else None)


class NativeBuildMissing(UserError):
    """No current build serves this run (``missing_message``): the environment lacks a step of
    the install, not a bad input, so the CLI exits 1 as on other failures of the machine."""

    exit_code = 1


def missing_message(backend: str | None = None) -> str:
    """One line: no current build of ``backend`` (default: the installed one), and the fix."""
    backend = backend or installed_backend()
    flag = "" if backend == "cpu" else f" --backend {backend}"
    return (f"moe-offload needs its patched llama.cpp ({backend}) built from this checkout's "
            f"llamacpp/patches, and none is: run `moe-offload native build{flag}` (a few "
            "minutes, once; `pip install -e .` does it too)")


def _terminal():
    """Where progress goes at install time: the terminal if there is one (pip shows a build
    backend's output only with -v), else stderr."""
    try:
        return open("/dev/tty", "w", buffering=1)
    except OSError:
        return sys.stderr


def install_build() -> BuildInfo:
    """Build (or find) the patched llama.cpp CMAKE_ARGS asks for and record it as this
    install's. Progress lines at least every 20 s while it compiles."""
    out = _terminal()

    def say(line: str) -> None:
        print(f"moe-offload install: {line}", file=out, flush=True)

    req = request_from_cmake_args()
    say(f"the patched llama.cpp ({req.backend}): building once, a few minutes "
        "(cached afterwards)")
    info = build(req, log=say)
    record_install(info)
    say(f"llama.cpp ready: {info.lib_dir}")
    if out is not sys.stderr:
        out.close()
    return info


def _main() -> int:          # python -m runtime.native.install: what setup.py does
    try:
        install_build()
    except UserError as exc:
        print(f"moe-offload install: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(_main())

