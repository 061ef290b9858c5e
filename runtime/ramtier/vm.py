"""Thin wrappers over the Linux virtual-memory calls the RAM tier needs (ctypes on libc).

Every function takes raw addresses (``int``) inside a mapping someone else made (llama.cpp's
model mapping at run time), and raises ``OSError`` with errno on failure. ctypes releases the
GIL for the duration of each call, so ``madvise(MADV_WILLNEED)`` from several threads really
overlaps.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import os
import resource
from dataclasses import dataclass

import numpy as np

MADV_NORMAL = 0
MADV_RANDOM = 1
MADV_WILLNEED = 3
MADV_DONTNEED = 4
MADV_COLD = 20
MADV_PAGEOUT = 21  # Linux >= 5.4: reclaim these pages now

PAGE_SIZE = os.sysconf("SC_PAGE_SIZE")  # bytes

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
for _name in ("madvise", "mlock", "munlock"):
    _fn = getattr(_libc, _name)
    _fn.argtypes = (ctypes.c_void_p, ctypes.c_size_t) + ((ctypes.c_int,) if _name == "madvise" else ())
    _fn.restype = ctypes.c_int
_libc.mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p)
_libc.mincore.restype = ctypes.c_int


def _check(rc: int, what: str) -> None:
    if rc != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def page_span(addr: int, length: int) -> tuple[int, int]:
    """The page-aligned span ``(start, length)`` covering ``[addr, addr + length)``."""
    start = addr - addr % PAGE_SIZE
    end = -(-(addr + length) // PAGE_SIZE) * PAGE_SIZE
    return start, end - start


def madvise(addr: int, length: int, advice: int) -> None:
    """``madvise`` over the pages covering ``[addr, addr + length)``."""
    start, span = page_span(addr, length)
    if span:
        _check(_libc.madvise(start, span, advice), f"madvise({advice})")


def mincore(addr: int, length: int) -> np.ndarray:
    """Residency of the pages covering ``[addr, addr + length)``: (n_pages,) bool.

    For a shared file mapping this is the page-cache state of the file's pages, whether or not
    this process has them mapped.
    """
    start, span = page_span(addr, length)
    vec = np.zeros(span // PAGE_SIZE, dtype=np.uint8)
    if span:
        _check(_libc.mincore(start, span, vec.ctypes.data), "mincore")
    return (vec & 1).astype(bool)


def mlock(addr: int, length: int) -> None:
    """Lock the pages covering the range in RAM (faults them in)."""
    start, span = page_span(addr, length)
    _check(_libc.mlock(start, span), "mlock")


def munlock(addr: int, length: int) -> None:
    """Unlock the pages covering the range."""
    start, span = page_span(addr, length)
    _check(_libc.munlock(start, span), "munlock")


def fadvise_dontneed(fd: int, offset: int, length: int) -> None:
    """Drop the file's clean, unmapped page-cache pages fully inside ``[offset, +length)``."""
    os.posix_fadvise(fd, offset, length, os.POSIX_FADV_DONTNEED)


@dataclass(frozen=True)
class MemlockLimits:
    soft_bytes: int | None     # None: unlimited
    cap_ipc_lock: bool         # CAP_IPC_LOCK ignores RLIMIT_MEMLOCK

    def allows(self, nbytes: int) -> bool:
        """Whether locking ``nbytes`` more bytes can succeed under the limit."""
        return self.cap_ipc_lock or self.soft_bytes is None or nbytes <= self.soft_bytes

    def describe(self) -> str:
        """One line for messages: the limit as the user would set it."""
        if self.cap_ipc_lock:
            return "CAP_IPC_LOCK (no limit)"
        if self.soft_bytes is None:
            return "RLIMIT_MEMLOCK unlimited"
        return f"RLIMIT_MEMLOCK {self.soft_bytes // 1024} KiB (raise with `ulimit -l` or limits.conf)"


def memlock_limits() -> MemlockLimits:
    """This process's mlock allowance."""
    soft, _hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    cap = False
    try:
        with open("/proc/self/status", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("CapEff:"):
                    cap = bool(int(line.split()[1], 16) & (1 << 14))  # CAP_IPC_LOCK = 14
    except OSError:
        pass
    return MemlockLimits(None if soft == resource.RLIM_INFINITY else int(soft), cap)


def max_request_bytes(path: str) -> int | None:
    """The largest read request the block device holding ``path`` takes (its
    ``queue/max_sectors_kb``, a partition's from its disk), or None where sysfs does not say
    (a network or FUSE filesystem, no sysfs)."""
    try:
        st = os.stat(path)
        dev = os.path.realpath(f"/sys/dev/block/{os.major(st.st_dev)}:{os.minor(st.st_dev)}")
        for queue in (os.path.join(dev, "queue"), os.path.join(os.path.dirname(dev), "queue")):
            if os.path.isfile(os.path.join(queue, "max_sectors_kb")):
                with open(os.path.join(queue, "max_sectors_kb")) as fh:
                    return int(fh.read()) * 1024
    except (OSError, ValueError):
        pass
    return None
