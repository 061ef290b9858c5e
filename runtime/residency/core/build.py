"""Build and load moe-offload's C library: the residency core (``residency_core.c`` and the
files core_impl.h lists), the
routing hook that calls it from llama.cpp's graph (``runtime/engine/route_hook.c``), the
device cache's mechanism it drives (``runtime/native/device_cache.c``) and the RAM tier's
per-layer reads and drops (``runtime/ramtier/tier_io.c``).

Compiled on first use (``$CC``, else ``cc``; plain C, no Python headers) into the cache's
``residency/`` folder, named by a hash of the sources, and opened with cffi in ABI mode. A
machine without a compiler gets one clear line (``UserError``) naming what is missing.

    lib, ffi = load_core()
"""
from __future__ import annotations

import hashlib
import os
import re
import shlex
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

from cffi import FFI

from runtime.cache import cache_dir
from runtime.errors import UserError

HERE = Path(__file__).resolve().parent
ENGINE = HERE.parents[1] / "engine"
NATIVE = HERE.parents[1] / "native"
RAMTIER = HERE.parents[1] / "ramtier"
SOURCES = (HERE / "residency_core.c", HERE / "lifetime.c", HERE / "api.c", HERE / "order.c",
           HERE / "policies.c", HERE / "prefetch.c", HERE / "verify.c", HERE / "step.c",
           HERE / "next_visit.c", HERE / "nv_victim.c", HERE / "nv_lists.c",
           HERE / "affinity.c", HERE / "neighbours.c",
           ENGINE / "route_hook.c", ENGINE / "route_consumers.c", ENGINE / "route_impose.c",
           NATIVE / "device_cache.c", RAMTIER / "tier_io.c", RAMTIER / "file_pages.c")
HEADERS = (HERE / "residency_core.h", ENGINE / "route_hook.h", NATIVE / "device_cache.h",
           RAMTIER / "tier_io.h")
# included by the sources only (not part of the cdef)
INTERNAL = (HERE / "core_impl.h", HERE / "order_heap.h", HERE / "next_visit.h",
            HERE / "nv_victim.h", HERE / "nv_victim_impl.h", HERE / "v2d.h",
            HERE / "affinity.h", HERE / "neighbours.h", HERE / "grow.h", ENGINE / "route_hook_impl.h", RAMTIER / "file_pages.h")
_lock = threading.Lock()
_loaded: tuple | None = None


def _cdef() -> str:
    text = "\n".join(re.sub(r"/\*.*?\*/", "", h.read_text(), flags=re.S) for h in HEADERS)
    return "\n".join(ln for ln in text.splitlines() if not ln.lstrip().startswith("#"))


# -ffp-contract=off: no fused multiply-add where a target has one (aarch64 fuses a + b * c by
# default), so the core's doubles stay its Python reference's
FLAGS = ("-O2", "-ffp-contract=off", "-shared", "-fPIC")


def library_path() -> Path:
    digest = hashlib.sha256(b"".join(p.read_bytes() for p in (*SOURCES, *HEADERS, *INTERNAL)))
    digest.update(" ".join((os.environ.get("CC", ""), *FLAGS)).encode())   # another CC: its own
    return cache_dir("residency") / f"moe_offload_native-{digest.hexdigest()[:16]}.so"


def _compile(target: Path) -> None:
    cc = shlex.split(os.environ.get("CC", "")) or [shutil.which("cc") or shutil.which("gcc")
                                                   or ""]
    if not cc[0]:
        raise UserError("the residency core needs a C compiler: install one (e.g. "
                        "`apt-get install gcc`) or set CC")
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        cmd = [*cc, *FLAGS, "-o", tmp, *map(str, SOURCES), "-lm",
               "-lpthread"]
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
        except OSError as exc:
            raise UserError(f"the residency core could not be compiled ({cc[0]}: "
                            f"{exc.strerror})") from None
        if done.returncode != 0:
            lines = done.stderr.strip().splitlines() or ["?"]
            last = next((ln for ln in lines if "error" in ln), lines[-1]).strip()
            raise UserError(f"the residency core could not be compiled: {last}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def load_core() -> tuple:
    """(lib, ffi) of the compiled core (built once per source version)."""
    global _loaded
    with _lock:
        if _loaded is None:
            path = library_path()
            if not path.is_file():
                _compile(path)
            ffi = FFI()
            ffi.cdef(_cdef())
            _loaded = (ffi.dlopen(str(path)), ffi)
        return _loaded
