"""Watch a process's memory from outside while it loads and runs a model.

Every ``interval`` seconds, on a thread of the watching process:
  * expert bytes of the model file in the page cache: ``mincore`` over the experts' byte ranges
    through the watcher's own read-only mapping of the file (never touched, so it faults nothing
    in and pins nothing: mincore reports the page cache whoever has the pages mapped);
  * the whole file's bytes in the page cache (dense weights too);
  * the process's anonymous and file-backed RSS (``/proc/PID/status``: RssAnon, RssFile) — an
    anonymous copy of the experts (llama.cpp's CPU weight repacking) shows up here;
  * its bytes read from storage (``/proc/PID/io`` read_bytes) and, in a cgroup v1 memory group,
    the group's charge (RAM + page cache).
The peaks are what a memory bound is checked against (tests/runtime/ramtier/test_bounded_load.py)
and what the real-scale benchmark reports (scripts/bench_realscale.py).
"""
from __future__ import annotations

import contextlib
import ctypes
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from runtime.ramtier import vm

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                       ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_PROT_READ, _MAP_SHARED = 1, 1


@dataclass(frozen=True, slots=True)
class MemSample:
    t: float                    # seconds since the watch started
    expert_cache_bytes: int     # expert bytes of the file in the page cache (mincore)
    file_cache_bytes: int       # every byte of the file in the page cache (mincore)
    rss_anon_bytes: int         # the process's anonymous resident memory
    rss_file_bytes: int         # its file-backed resident memory (mapped pages)
    read_bytes: int             # its bytes read from storage so far
    cgroup_bytes: int | None    # its memory group's charge (None: not in a group we watch)


def expert_spans(model_path: str | os.PathLike) -> list[tuple[int, int]]:
    """(offset, length) of every routed expert's bytes in the file, merged where adjacent."""
    from gguf_tools.expert_index import ExpertIndex  # noqa: PLC0415
    from runtime.ramtier.layout import ExpertLayout  # noqa: PLC0415

    return ExpertLayout.from_index(ExpertIndex.open(model_path)).merged_spans()


def _map_read_only(fd: int, size: int, path: str | os.PathLike) -> int:
    """The address of a shared read-only mapping of ``size`` bytes of ``fd`` (never read here:
    only looked at with mincore), OSError when the kernel refuses."""
    addr = _libc.mmap(None, size, _PROT_READ, _MAP_SHARED, fd, 0)
    if addr in (None, ctypes.c_void_p(-1).value):
        raise OSError(ctypes.get_errno(), f"mmap {path}")
    return addr


def cached_pages(path: str | os.PathLike) -> np.ndarray:
    """Which pages of the file are in the page cache now (mincore over a mapping never read:
    looking brings nothing in), one bool per page."""
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        if size == 0:
            return np.zeros(0, dtype=bool)
        addr = _map_read_only(fd, size, path)
        try:
            return vm.mincore(addr, size).copy()
        finally:
            _libc.munmap(ctypes.c_void_p(addr), size)
    finally:
        os.close(fd)


def _status_bytes(pid: int, *names: str) -> dict[str, int]:
    out = dict.fromkeys(names, 0)
    try:
        with open(f"/proc/{pid}/status", encoding="ascii") as fh:
            for line in fh:
                key, _, rest = line.partition(":")
                if key in out:
                    out[key] = int(rest.split()[0]) * 1024
    except OSError:
        pass
    return out


def process_read_bytes(pid: int) -> int:
    """Bytes ``pid`` has read from storage (/proc/PID/io), 0 when it cannot be read."""
    try:
        with open(f"/proc/{pid}/io", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("read_bytes:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


class MemoryWatch:
    """``with MemoryWatch(model, pid) as w: ...; w.samples, w.peak()``. ``pid`` may be set
    later (``w.pid = child.pid``): until then only the page cache is sampled."""

    def __init__(self, model_path: str | os.PathLike, pid: int | None = None, *,
                 interval: float = 0.05, cgroup_dir: str | os.PathLike | None = None,
                 spans: list[tuple[int, int]] | None = None):
        self.model_path = os.fspath(model_path)
        self.pid = pid
        self.interval = interval
        self.cgroup_dir = Path(cgroup_dir) if cgroup_dir is not None else None
        self.spans = spans if spans is not None else expert_spans(self.model_path)
        self.samples: list[MemSample] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._fd = -1
        self._base = 0                        # our read-only mapping of the file, never read
        self._size = 0

    def __enter__(self) -> MemoryWatch:
        self._fd = os.open(self.model_path, os.O_RDONLY)
        self._size = os.fstat(self._fd).st_size
        try:
            self._base = _map_read_only(self._fd, self._size, self.model_path)
        except OSError:
            os.close(self._fd)
            raise
        n_pages = -(-self._size // vm.PAGE_SIZE)
        self._expert_pages = np.zeros(n_pages, dtype=bool)    # pages holding expert bytes
        for off, n in self.spans:
            self._expert_pages[off // vm.PAGE_SIZE:-(-(off + n) // vm.PAGE_SIZE)] = True
        self._t0 = time.monotonic()
        self._thread = threading.Thread(target=self._run, name="memwatch", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.sample()                         # one last look
        if self._base:
            _libc.munmap(ctypes.c_void_p(self._base), self._size)
            self._base = 0
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def _run(self) -> None:
        # The instrument must not starve on a busy machine: above the watched process where
        # this user may raise a thread's priority (root), as it is elsewhere. Samples keep a
        # fixed cadence (the next is due an interval after the last was due, not after it ended).
        with contextlib.suppress(OSError, AttributeError):
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), -10)
        due = time.monotonic()
        while True:
            due = max(due + self.interval, time.monotonic() - self.interval)
            if self._stop.wait(max(0.0, due - time.monotonic())):
                break
            self.sample()

    def sample(self) -> MemSample | None:
        if not self._base:
            return None
        pages = vm.mincore(self._base, self._size)          # (n_pages,) bool
        experts = int(np.count_nonzero(pages & self._expert_pages)) * vm.PAGE_SIZE
        whole = int(np.count_nonzero(pages)) * vm.PAGE_SIZE
        rss = _status_bytes(self.pid, "RssAnon", "RssFile") if self.pid else {}
        group = None
        if self.cgroup_dir is not None:
            try:
                group = int((self.cgroup_dir / "memory.usage_in_bytes").read_text())
            except (OSError, ValueError):
                group = None
        s = MemSample(time.monotonic() - self._t0, experts, whole, rss.get("RssAnon", 0),
                      rss.get("RssFile", 0),
                      process_read_bytes(self.pid) if self.pid else 0, group)
        self.samples.append(s)
        return s

    def peak(self, field: str) -> int:
        values = [getattr(s, field) or 0 for s in self.samples]
        return max(values) if values else 0
