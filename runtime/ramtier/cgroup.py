"""cgroup memory: a v1 limit for one benchmark child, so a model file larger than the limit
really pages (the page cache is charged to the group), removed again afterwards; and the limit
this process runs under (``group_memory``, v1 or v2), which loading checks against.

``MemoryLimit`` needs Linux with the v1 ``memory`` controller mounted at /sys/fs/cgroup/memory
and write access to our own group (root in a container); ``MemoryLimit.supported()`` says
whether it is there.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

V1_ROOT = Path("/sys/fs/cgroup/memory")
V2_ROOTS = (Path("/sys/fs/cgroup/unified"), Path("/sys/fs/cgroup"))
NO_LIMIT = 1 << 60            # bytes: v1 writes "no limit" as 2**63 rounded down to a page


@dataclass(frozen=True)
class GroupMemory:
    """The memory limit of this process's cgroup (the smallest over its ancestors too)."""

    limit_bytes: int        # bytes the group may hold: RAM + page cache it cannot reclaim
    anon_bytes: int         # bytes of anonymous memory the limiting group holds now
    source: str             # the file the limit is in (for messages)


def group_memory() -> GroupMemory | None:
    """The limit this process runs under, or None when no memory cgroup limits it."""
    found = []
    for controllers, rel in _cgroup_lines():
        if "memory" in controllers:
            found += _limits(V1_ROOT, rel, "memory.limit_in_bytes", "total_rss")
        elif controllers == [""]:
            for root in V2_ROOTS:
                if (root / "cgroup.controllers").exists():
                    found += _limits(root, rel, "memory.max", "anon")
                    break
    return min(found, key=lambda g: g.limit_bytes) if found else None


def _cgroup_lines() -> list[tuple[list[str], str]]:
    try:
        with open("/proc/self/cgroup", encoding="ascii") as fh:
            rows = [line.rstrip("\n").split(":", 2) for line in fh]
    except OSError:
        return []
    return [(r[1].split(","), r[2]) for r in rows if len(r) == 3]


def _limits(root: Path, rel: str, limit_file: str, anon_key: str) -> list[GroupMemory]:
    """The limits of the group at ``root/rel`` and of each ancestor below ``root``."""
    out = []
    group = root / rel.lstrip("/")
    while True:
        try:
            text = (group / limit_file).read_text().strip()
        except OSError:
            text = ""
        if text and text != "max" and int(text) < NO_LIMIT:
            out.append(GroupMemory(int(text), _stat(group, anon_key), str(group / limit_file)))
        if group == root or root not in group.parents:
            return out
        group = group.parent


def _stat(group: Path, key: str) -> int:
    try:
        for line in (group / "memory.stat").read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == key:
                return int(value)
    except (OSError, ValueError):
        pass
    return 0


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
