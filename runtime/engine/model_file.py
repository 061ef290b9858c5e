"""The served model file, watched: its identity (device, inode), size and modification time
are compared before each batch with what they were at load, and, where the server can, it is
leased through each batch so that nobody cuts it while llama.cpp reads it.

llama.cpp reads the weights through a mapping of the file (``mmap``): a page past the end of a
file cut short under a running process is a SIGBUS at the next read, which ends the process with
no log line. So every ``llama_decode`` runs inside ``batch()``, which fails with
``ModelFileChanged`` while the file differs (one ``stat`` a part: a few microseconds):

    watch = ModelFileWatch("model.gguf", guard=True)  # before the load: what llama.cpp maps
    with watch.batch():                    # ModelFileChanged, or the batch runs
        llama_decode(...)
    watch.fault()                          # for /health: a Fault while it differs, else None

Truncated, replaced (another inode under the name, or the name gone) and rewritten (same inode,
a new size or modification time) all differ. A file put back as it was loaded (the same inode,
size and mtime: ``cp -p`` or ``touch -r`` over the same file) serves again: the mapping reads
the file's bytes again. A replaced file is not reloaded: restart the server.

A check alone misses a change that lands during a batch (a truncation while the server
generates killed it 3 times in 4). With ``guard`` (``serve``: runtime/engine/file_lease.py) each
part is read-leased: another process's truncate or open for writing waits until the batch in
flight ends and the lease is given back; the batches after it fail while the file is open for
writing or differs. Where no lease can be had (not Linux, NFS, another user's file) the check
is all there is.
"""
from __future__ import annotations

import os
import re
import threading
from dataclasses import dataclass

from runtime.engine import file_lease
from runtime.engine.file_lease import FileLease
from runtime.engine.types import Fault, ModelFileChanged

_SPLIT = re.compile(r"-(\d{5})-of-(\d{5})\.gguf$")     # llama.cpp's split parts
WRITING = "being written: another process has it open for writing"


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
    engine's thread runs each batch inside ``batch()``, ``/health`` asks from another.

    ``guard``: hold a read lease on each part through every batch (runtime/engine/file_lease:
    Linux, once ``file_lease.handle_breaks()`` ran on the main thread), so that a writer or a
    truncation from another process waits for the batch in flight to end, and the batches
    after it fail: without it a file cut during a batch is read past its end (SIGBUS)."""

    def __init__(self, path: str, *, guard: bool = False):
        self.path = path
        parts = [p for p in model_parts(path) if os.path.exists(p)] or [path]
        self._loaded = {p: FileIdentity.of(p) for p in parts}   # taken before the load maps them
        self._lock = threading.Lock()
        self._change: str | None = None      # the change the last check saw (None: as loaded)
        self._batch = threading.Lock()       # held through each batch
        self._breaking = threading.Event()   # a lease's break is pending: give them back
        self._writing: str | None = None     # a part another process has open for writing
        self._leases: list[FileLease] = []
        self._closed = False
        if guard and file_lease.breaks_handled():
            try:
                self._leases = [FileLease(p, self._breaking.set) for p in parts]
            except OSError:
                self._leases = []            # cannot open them for a lease: the check alone
            else:                            # gives the leases back when no batch runs
                threading.Thread(target=self._keep, name="moe-offload-lease",
                                 daemon=True).start()

    def batch(self) -> ModelFileWatch:
        """``with watch.batch():`` runs one batch: ``ModelFileChanged`` unless every part is
        as loaded (and, guarded, leased so that nobody changes it until the batch ends)."""
        return self

    def __enter__(self) -> None:           # a plain context manager: ~1 us less than contextlib
        self._batch.acquire()
        try:
            self._hold_leases()
            self.check()
        except BaseException:
            self._batch.release()
            raise

    def __exit__(self, *exc) -> None:
        self._batch.release()

    def _hold_leases(self) -> None:
        if self._breaking.is_set():          # a writer waits: let it go, then refuse batches
            self._breaking.clear()           # until the file is as loaded again
            for lease in self._leases:
                lease.release()
        for lease in self._leases:
            if lease.held:
                continue
            try:
                taken = lease.take()
            except file_lease.LeaseUnavailable:
                self._drop_leases()          # this file system or owner: the check alone
                return
            if not taken:
                self._writing = lease.path
                self._raise(lease.path, WRITING)
        self._writing = None

    def _keep(self) -> None:
        """A lease's break (SIGIO sets ``_breaking``): the leases go back once the batch in
        flight, if any, has ended (or at the next batch's start, whichever comes first)."""
        while not self._closed:
            self._breaking.wait()
            with self._batch:                # after the batch in flight
                if self._breaking.is_set():
                    self._breaking.clear()
                    for lease in self._leases:
                        lease.release()

    def _drop_leases(self) -> None:
        leases, self._leases = self._leases, []
        for lease in leases:
            lease.close()

    def close(self) -> None:
        """Let the leases go (the engine is closing)."""
        with self._batch:
            self._closed = True
            self._drop_leases()
        self._breaking.set()                 # the keeper wakes and ends

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
        if found is None:
            with self._lock:
                self._change = None
            return
        self._raise(*found)

    def _raise(self, part: str, change: str) -> None:
        with self._lock:
            first, self._change = change != self._change, change
        raise ModelFileChanged(part, change, first=first)

    def fault(self) -> Fault | None:
        """The file's state for /health, looked at now."""
        found = self._compare()
        if found is None and self._writing is not None:
            found = self._writing, WRITING
        if found is None:
            return None
        part, change = found
        return Fault("model_file", str(ModelFileChanged(part, change)), serving=False)
