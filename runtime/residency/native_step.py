"""Build and load ``_lru_step.c``, the C version of ``lru_step.lru_step``.

The extension is compiled on first use with the system C compiler (``$CC``, else ``cc``)
against this Python's headers, into the cache's ``residency/`` folder (``runtime/cache.py``), named by a hash of the source and the Python ABI so that a changed source or
interpreter rebuilds it. Anything that fails (no compiler, no headers, a read-only cache) falls
back to the Python reference, which decides identically; ``step_impl()`` says which one runs.
``MOE_OFFLOAD_NATIVE_STEP=0`` forces the reference.

    from runtime.residency.native_step import load_lru_step
    lru_step = load_lru_step()       # the C function, or lru_step.lru_step
"""
from __future__ import annotations

import hashlib
import importlib.machinery
import importlib.util
import os
import shlex
import subprocess
import sysconfig
import tempfile
import threading
from pathlib import Path
from typing import Callable

from runtime.cache import cache_dir
from runtime.residency import lru_step as reference

SOURCE = Path(__file__).with_name("_lru_step.c")
_lock = threading.Lock()
_loaded: dict[str, Callable] = {}
_why_not = ""


def _build(target: Path) -> None:
    """Compile SOURCE into ``target`` (atomically: a temp file, then a rename)."""
    include = sysconfig.get_paths()["include"]
    if not (Path(include) / "Python.h").exists():
        raise RuntimeError(f"no Python.h in {include}")
    cc = shlex.split(os.environ.get("CC", "cc"))
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        cmd = [*cc, "-O2", "-shared", "-fPIC", f"-I{include}", str(SOURCE), "-o", tmp]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed: {done.stderr.strip()[-500:]}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _load_native() -> Callable:
    source = SOURCE.read_bytes()
    tag = hashlib.sha256(source + sysconfig.get_config_var("EXT_SUFFIX").encode()).hexdigest()
    suffix = sysconfig.get_config_var("EXT_SUFFIX")
    target = cache_dir("residency") / f"_lru_step-{tag[:16]}{suffix}"
    if not target.exists():
        _build(target)
    loader = importlib.machinery.ExtensionFileLoader("_lru_step", str(target))
    spec = importlib.util.spec_from_file_location("_lru_step", str(target), loader=loader)
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module.lru_step


def load_lru_step(native: bool | None = None) -> Callable:
    """The lru_step to use: the C one when it builds (``native`` None: unless
    MOE_OFFLOAD_NATIVE_STEP=0), else the Python reference. Built once per process."""
    global _why_not
    if native is None:
        native = os.environ.get("MOE_OFFLOAD_NATIVE_STEP", "1") != "0"
    if not native:
        return reference.lru_step
    with _lock:
        if "c" not in _loaded and not _why_not:
            try:
                _loaded["c"] = _load_native()
            except Exception as exc:  # noqa: BLE001 - any failure: the reference decides alike
                _why_not = f"{type(exc).__name__}: {exc}"
        return _loaded.get("c", reference.lru_step)


def step_impl(fn: Callable) -> str:
    """'c' or 'python' for a function load_lru_step returned."""
    return "python" if fn is reference.lru_step else "c"


def why_not_native() -> str:
    """Why the C version is not in use ('' when it is, or was never asked for)."""
    return _why_not
