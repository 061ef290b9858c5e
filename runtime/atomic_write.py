"""Atomic file writes: every file the product writes goes through here.

A writer writes to a temp file beside the target, fsyncs it, renames it over the target and
fsyncs the directory. A reader therefore sees the old file or the whole new one, never a part:
a killed writer (SIGKILL, OOM, power loss after the rename) or a full disk leaves the previous
file byte-identical.

    with atomic_write("out.npz", "wb") as f:     # a file object on the temp file
        f.write(data)                            # leaving the block publishes; an error discards

    target = AtomicTarget("slot.bin")            # for writers that need a path (C code, GGUF)
    c_function_that_writes(str(target.tmp))
    target.publish()                             # or target.discard()

Temp files are named ``.NAME.tmp-PID-RANDOM`` (extra files of one write add ``.SUFFIX``), in
the target's directory so the rename never crosses a file system. A temp file of a process that
no longer runs is stale: the next writer of the same target removes it (``remove_stale_temps``),
and a normal interpreter exit removes the live ones of its own process. Names the product wrote
before this module (``NAME.tmpPID[.x]``, ``.NAME.PID.partial``) are stale temps too.

Failures are a ``UserError`` of one line naming the target (``OSError`` strerror: "File too
large", "No space left on device"), the temp file gone.
"""
from __future__ import annotations

import atexit
import contextlib
import errno
import os
import re
import secrets
from collections.abc import Iterator
from pathlib import Path
from typing import IO

from runtime.errors import UserError

_LIVE: set[Path] = set()           # temp files of this process not yet published or discarded


# What follows the target's name in its temp files' names (fixed patterns, compiled once: a
# pattern per target name would fill ``re``'s cache with clients' slot file names)
_OURS = re.compile(r"\.tmp-(?P<pid>\d+)-[0-9a-f]+(?:\..*)?")      # after "." * n + NAME
_OLD = re.compile(r"\.tmp(?P<pid>\d+)(?:\..*)?")                   # after NAME
_PARTIAL = re.compile(r"\.(?P<pid>\d+)\.partial")                  # after "." + NAME


def temp_of(target_name: str, entry: str) -> tuple[int, bool] | None:
    """(pid, ours) if ``entry`` names a temp file of the target named ``target_name``: the
    process that wrote it, and whether it is this module's form (``.NAME.tmp-PID-RANDOM``)
    rather than an older one; else None."""
    # leading dots: a scratch file of one write (``extra``) written atomically itself
    for dots in range(1, len(entry) - len(target_name)):
        if entry[dots - 1] != ".":
            break
        if entry.startswith(target_name, dots):
            m = _OURS.fullmatch(entry, dots + len(target_name))
            if m is not None:
                return int(m.group("pid")), True
    for pattern, at in ((_OLD, 0), (_PARTIAL, 1)):
        if entry.startswith(target_name, at) and (at == 0 or entry[0] == "."):
            m = pattern.fullmatch(entry, at + len(target_name))
            if m is not None:
                return int(m.group("pid")), False
    return None


def remove_stale_temps(target: str | os.PathLike) -> list[Path]:
    """Remove the temp files of ``target`` whose writing process is gone; returns them."""
    target = Path(target)
    removed = []
    try:
        names = os.listdir(target.parent)
    except OSError:
        return removed
    for name in names:
        found = temp_of(target.name, name)
        if found is None:
            continue
        pid = found[0]
        if _alive(pid):
            continue
        path = target.parent / name
        with contextlib.suppress(OSError):
            path.unlink()
            removed.append(path)
    return removed


def scratch_path(target: str | os.PathLike, suffix: str) -> Path:
    """A scratch file beside ``target`` named like its temp files: removed at a normal exit,
    found stale by ``target``'s next writer after a kill. The caller removes it when done."""
    target = Path(target)
    p = target.with_name(f".{target.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}.{suffix}")
    _LIVE.add(p)
    return p


class AtomicTarget:
    """One atomic write of ``path``: write ``tmp`` (and ``extra(...)`` files), then ``publish()``
    or ``discard()``. Creating it removes ``path``'s stale temp files."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        remove_stale_temps(self.path)
        self.tmp = self.path.with_name(
            f".{self.path.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}")
        self._extras: list[Path] = []
        self.done = False
        _LIVE.add(self.tmp)

    def extra(self, suffix: str) -> Path:
        """A scratch file that belongs to this write (removed with it, found stale like it)."""
        p = self.tmp.with_name(f"{self.tmp.name}.{suffix}")
        self._extras.append(p)
        _LIVE.add(p)
        return p

    def publish(self) -> Path:
        """fsync the temp file, rename it over ``path``, fsync the directory; returns ``path``.
        On failure the temp file is removed and a one-line ``UserError`` raised."""
        try:
            fd = os.open(self.tmp, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(self.tmp, self.path)
        except OSError as err:
            self.discard()
            raise write_error(self.path, err) from None
        self.done = True
        self._forget(self.tmp)
        self._remove_extras()
        _fsync_dir(self.path.parent)
        return self.path

    def discard(self) -> None:
        """Remove the temp file and the extras. Idempotent."""
        self.done = True
        with contextlib.suppress(OSError):
            self.tmp.unlink()
        self._forget(self.tmp)
        self._remove_extras()

    def _remove_extras(self) -> None:
        for p in self._extras:
            with contextlib.suppress(OSError):
                p.unlink()
            self._forget(p)
        self._extras.clear()

    @staticmethod
    def _forget(p: Path) -> None:
        _LIVE.discard(p)


@contextlib.contextmanager
def atomic_write(path: str | os.PathLike, mode: str = "w", *,
                 encoding: str | None = None) -> Iterator[IO]:
    """Open a temp file beside ``path`` (``mode`` "w", "wb" or "w+b"); leaving the block
    publishes it atomically, an exception discards it. ``OSError`` becomes a one-line
    ``UserError``."""
    if mode not in ("w", "wb", "w+b"):
        raise ValueError(f"atomic_write: mode must be 'w', 'wb' or 'w+b', not {mode!r}")
    target = AtomicTarget(path)
    try:
        kwargs = {"encoding": encoding or "utf-8", "newline": "\n"} if mode == "w" else {}
        with open(target.tmp, mode, **kwargs) as f:
            yield f
            f.flush()
        target.publish()
    except OSError as err:
        target.discard()
        raise write_error(target.path, err) from None
    except BaseException:
        target.discard()
        raise


def write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """``path`` holds ``data``, atomically."""
    with atomic_write(path, "wb") as f:
        f.write(data)


def write_text(path: str | os.PathLike, text: str) -> None:
    """``path`` holds ``text`` (UTF-8, "\\n" line ends), atomically."""
    with atomic_write(path, "w") as f:
        f.write(text)


def write_error(path: Path, err: OSError) -> UserError:
    """The one line for a failed write of ``path``."""
    why = err.strerror or str(err)
    if err.errno == errno.EFBIG:
        why += ": the file-size limit, ulimit -f"
    return UserError(f"{path}: cannot write ({why}); the previous file, if any, is unchanged")


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:       # another user's process: alive
        return True
    except OverflowError:
        return False
    return True


def _fsync_dir(directory: Path) -> None:
    """Make the rename durable (best effort: some file systems cannot open a directory)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


@atexit.register
def _remove_live_temps() -> None:
    for p in list(_LIVE):
        with contextlib.suppress(OSError):
            p.unlink()
    _LIVE.clear()
