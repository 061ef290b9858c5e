"""The machine settings a real-scale figure depends on, read and (where allowed) set.

* ``read_ahead_kb`` of the block device holding a file: how much the kernel reads around a
  page fault. llama.cpp's mmap pays for it on every fault (at this VM's 8 MiB a decode token
  read 5.7 GB; at the usual 128 KiB, 124 MB); ``ReadAhead(path, kb)`` sets it for a benchmark
  and puts the old value back (root only: ``ReadAhead.applied`` says whether it took).
* the load: the 1-minute load average and the CPU pressure (PSI ``some avg10``), printed with
  every figure; ``BusyLoad(n)`` adds ``n`` busy processes (the "machine that does something
  else" case).
* ``warm(path)``: the whole file in the page cache, checked with mincore (the ceiling row: every
  expert resident); returns the share cached.
"""
from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np


def _queue_dir(path: str | os.PathLike) -> Path | None:
    """/sys/block/<disk>/queue of the device holding ``path`` (a partition's disk), or None."""
    st = os.stat(path)
    dev = Path(f"/sys/dev/block/{os.major(st.st_dev)}:{os.minor(st.st_dev)}")
    try:
        real = dev.resolve(strict=True)
    except OSError:
        return None
    for candidate in (real, real.parent):          # a partition's queue is its disk's
        if (candidate / "queue" / "read_ahead_kb").is_file():
            return candidate / "queue"
    return None


def read_ahead_kb(path: str | os.PathLike) -> int | None:
    """The read-ahead (KiB) of the device holding ``path``; None when it cannot be read."""
    q = _queue_dir(path)
    try:
        return int((q / "read_ahead_kb").read_text()) if q else None
    except (OSError, ValueError):
        return None


class ReadAhead:
    """``with ReadAhead(path, 128) as ra:`` the device's read-ahead is 128 KiB inside (when it
    can be written: ``ra.applied``), the old value after. ``kb`` None: leave it."""

    def __init__(self, path: str | os.PathLike, kb: int | None):
        self.path, self.kb = path, kb
        self.before = read_ahead_kb(path)
        self.applied = False

    def __enter__(self) -> ReadAhead:
        if self.kb is not None and self.kb != self.before:
            self.applied = _write_read_ahead(self.path, self.kb)
        return self

    def __exit__(self, *exc) -> None:
        if self.applied and self.before is not None:
            _write_read_ahead(self.path, self.before)

    @property
    def now(self) -> int | None:
        return read_ahead_kb(self.path)


def _write_read_ahead(path, kb: int) -> bool:
    q = _queue_dir(path)
    try:
        (q / "read_ahead_kb").write_text(str(kb))
        return True
    except (OSError, TypeError):
        return False


@dataclass(frozen=True)
class Load:
    """How busy the machine was: the 1-minute load average, CPU pressure, busy processes."""

    load1: float
    cpu_some_avg10: float | None     # % of time some runnable task waited for a CPU
    busy: int = 0                    # BusyLoad processes of ours running

    def describe(self) -> str:
        psi = f", CPU pressure {self.cpu_some_avg10:.0f}%" if self.cpu_some_avg10 is not None \
            else ""
        extra = f", {self.busy} busy processes beside it" if self.busy else ""
        return f"load {self.load1:.2f}{psi}{extra}"


def load_now(busy: int = 0) -> Load:
    psi = None
    try:
        for line in Path("/proc/pressure/cpu").read_text().splitlines():
            if line.startswith("some"):
                psi = float(line.split("avg10=")[1].split()[0])
    except (OSError, IndexError, ValueError):
        pass
    return Load(os.getloadavg()[0], psi, busy)


class BusyLoad:
    """``n`` processes spinning on the CPU while inside (a competing load, as any desktop that
    does something else has); they stop on exit."""

    def __init__(self, n: int):
        self.n = n
        self._procs: list[subprocess.Popen] = []

    def __enter__(self) -> BusyLoad:
        for _ in range(self.n):
            self._procs.append(subprocess.Popen(
                [sys.executable, "-c", "while True:\n    pass"],
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        return self

    def __exit__(self, *exc) -> None:
        for p in self._procs:
            p.kill()
        for p in self._procs:
            p.wait()
        self._procs.clear()


def warm(path: str | os.PathLike, passes: int = 3) -> float:
    """Read the whole file into the page cache, then read again what ``mincore`` says is not
    there (pages the kernel dropped while later ones came in), up to ``passes`` times; the
    share of the file's pages cached at the end (1.0: all). A ceiling row that starts below
    1.0 reads from disk and is not the compute limit: the caller says so."""
    from runtime.bench.memwatch import cached_pages  # noqa: PLC0415 - (numpy, only here)

    chunk = 8 << 20
    with open(path, "rb", buffering=0) as fh:
        while fh.read(chunk):
            pass
        for _ in range(passes):
            pages = cached_pages(path)
            missing = np.flatnonzero(~pages)
            if missing.size == 0:
                return 1.0
            page = os.sysconf("SC_PAGE_SIZE")
            for first in np.unique(missing * page // chunk):   # each 8 MiB block with a hole
                os.pread(fh.fileno(), chunk, int(first) * chunk)
    pages = cached_pages(path)
    return float(pages.mean()) if pages.size else 1.0
