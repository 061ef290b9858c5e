"""A cgroup v1 memory limit for one benchmark child, so a model file larger than the limit
really pages (the page cache is charged to the group). Removed again afterwards.

Linux with the v1 ``memory`` controller mounted at /sys/fs/cgroup/memory and write access
to our own group (root in a container). ``MemoryLimit.supported()`` says whether it is there.
"""
from __future__ import annotations

import os
import time
from pathlib import Path

V1_ROOT = Path("/sys/fs/cgroup/memory")


def _own_group() -> Path | None:
    try:
        with open("/proc/self/cgroup", encoding="ascii") as fh:
            for line in fh:
                _, controllers, path = line.rstrip("\n").split(":", 2)
                if "memory" in controllers.split(","):
                    return V1_ROOT / path.lstrip("/")
    except OSError:
        return None
    return None


class MemoryLimit:
    """``with MemoryLimit(bytes) as group: Popen(..., preexec_fn=group.join)``."""

    def __init__(self, limit_bytes: int, name: str | None = None):
        self.limit_bytes = int(limit_bytes)
        parent = _own_group()
        self.path = None if parent is None else parent / (name or f"moe-bench-{os.getpid()}")

    @staticmethod
    def supported() -> bool:
        """Whether a child memory group can be made here."""
        parent = _own_group()
        return parent is not None and (parent / "memory.limit_in_bytes").exists() and \
            os.access(parent, os.W_OK)

    def __enter__(self) -> MemoryLimit:
        if self.path is None or not self.supported():
            raise OSError("cgroup v1 memory controller not available (no memory limit possible)")
        self.path.mkdir(exist_ok=True)
        (self.path / "memory.limit_in_bytes").write_text(str(self.limit_bytes))
        return self

    def join(self) -> None:
        """Move the calling process into the group (use as ``preexec_fn``)."""
        (self.path / "cgroup.procs").write_text(str(os.getpid()))

    def peak_bytes(self) -> int:
        """memory.max_usage_in_bytes: the group's peak charge (RAM + page cache)."""
        return int((self.path / "memory.max_usage_in_bytes").read_text())

    def __exit__(self, *exc) -> None:
        if self.path is None or not self.path.exists():
            return
        for _ in range(50):     # the child may still be exiting
            try:
                if not (self.path / "cgroup.procs").read_text().strip():
                    break
            except OSError:
                break
            time.sleep(0.1)
        try:
            (self.path / "memory.force_empty").write_text("0")
        except OSError:
            pass
        try:
            self.path.rmdir()
        except OSError:
            pass
