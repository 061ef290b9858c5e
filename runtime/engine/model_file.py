"""The served model file, watched: its identity (device, inode), size and modification time
are compared before each batch with what they were at load.

llama.cpp reads the weights through a mapping of the file (``mmap``): a page past the end of a
file cut short under a running process is a SIGBUS at the next read, which ends the process with
no log line. So the engine checks the file before every ``llama_decode`` (one ``stat`` per part:
about a microsecond) and fails the batch with ``ModelFileChanged`` while the file differs:

    watch = ModelFileWatch("model.gguf")   # before the load: the identity llama.cpp maps
    watch.check()                          # before each batch: ModelFileChanged, or nothing
    watch.fault()                          # for /health: a Fault while it differs, else None

Truncated, replaced (another inode under the name, or the name gone) and rewritten (same inode,
a new size or modification time) all differ. A file put back as it was loaded (the same inode,
size and mtime: ``cp -p`` or ``touch -r`` over the same file) serves again: the mapping reads
the file's bytes again. A replaced file is not reloaded: restart the server. A change that lands
during a batch (its milliseconds) is not seen before it (this is a check, not a lock).
"""
from __future__ import annotations

import os
import re
import threading
from dataclasses import dataclass

from runtime.engine.types import Fault, ModelFileChanged

_SPLIT = re.compile(r"-(\d{5})-of-(\d{5})\.gguf$")     # llama.cpp's split parts


@dataclass(frozen=True, slots=True)
class FileIdentity:
    """What ``stat`` says of one file: equal identities, the same bytes (short of an edit
    that keeps the size and restores the mtime)."""

    device: int
    inode: int
    size: int               # bytes
    mtime_ns: int

    @property
    def key(self) -> tuple[int, int, int, int]:
        return self.device, self.inode, self.size, self.mtime_ns

    @classmethod
    def of(cls, path: str) -> FileIdentity:
        st = os.stat(path)
        return cls(st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)

    def change(self, now: FileIdentity) -> str:
        """How ``now`` differs from this identity, in a few words."""
        if (now.device, now.inode) != (self.device, self.inode):
            return "replaced: another file has its name now"
        if now.size < self.size:
            return f"truncated to {now.size} bytes from {self.size}"
        if now.size > self.size:
            return f"rewritten: {now.size} bytes, {self.size} at load"
        return "rewritten in place: its modification time changed"


def model_parts(path: str) -> list[str]:
    """Every file llama.cpp maps for ``path``: all parts of a split model
    (``NAME-00001-of-00003.gguf``), else ``path`` alone."""
    match = _SPLIT.search(path)
    if match is None:
        return [path]
    total = int(match.group(2))
    return [f"{path[:match.start()]}-{i:05d}-of-{total:05d}.gguf" for i in range(1, total + 1)]


class ModelFileWatch:
    """A model's files as they were at load (see the module docstring). Thread-safe: the
    engine's thread checks before each batch, ``/health`` asks from another."""

    def __init__(self, path: str):
        self.path = path
        parts = [p for p in model_parts(path) if os.path.exists(p)] or [path]
        self._loaded = {p: FileIdentity.of(p) for p in parts}   # taken before the load maps them
        self._lock = threading.Lock()
        self._change: str | None = None      # the change the last check saw (None: as loaded)

    def _compare(self) -> tuple[str, str] | None:
        """(part, change) for the first part that differs from its load, or None."""
        for part, loaded in self._loaded.items():
            try:
                now = FileIdentity.of(part)
            except FileNotFoundError:
                return part, "removed: no file has its name now"
            except OSError as exc:
                return part, f"cannot stat it: {exc.strerror}"
            if now != loaded:
                return part, loaded.change(now)
        return None

    def check(self) -> None:
        """Raise ``ModelFileChanged`` while a part differs from its load; ``first`` is set
        on the first failure of each new change (the server logs it once)."""
        for part, loaded in self._loaded.items():   # the fast path: one stat a part
            try:
                st = os.stat(part)
            except OSError:
                break
            if (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns) != loaded.key:
                break
        else:
            if self._change is not None:
                with self._lock:
                    self._change = None
            return
        found = self._compare()
        with self._lock:
            if found is None:
                self._change = None
                return
            part, change = found
            first, self._change = change != self._change, change
        raise ModelFileChanged(part, change, first=first)

    def fault(self) -> Fault | None:
        """The file's state for /health, looked at now."""
        found = self._compare()
        if found is None:
            return None
        part, change = found
        return Fault("model_file", str(ModelFileChanged(part, change)), serving=False)
