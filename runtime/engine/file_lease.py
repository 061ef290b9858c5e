"""A read lease on a file (Linux ``fcntl(F_SETLEASE, F_RDLCK)``): while this process holds it,
another process that opens the file for writing or truncates it waits until the lease is let go
(at most ``/proc/sys/fs/lease-break-time`` seconds, 45 by default), and this process learns of
it by a signal (SIGIO). The model file's watch (model_file.py) holds one through every batch,
so that a file cut short is never cut while llama.cpp reads its mapping (a SIGBUS).

    handle_breaks()                  # the main thread, once: SIGIO tells the leases
    lease = FileLease(path, on_break)   # on_break(): in a signal handler, so set a flag only
    lease.take()                     # False: another process has the file open for writing
    lease.release(); lease.close()

SIGIO's default action ends the process, so no lease is taken until ``handle_breaks()`` ran:
``breaks_handled()`` says whether it did. A file system without leases (NFS, FUSE), or a file
this user may not lease (another owner, no CAP_LEASE), raises ``LeaseUnavailable``.
"""
from __future__ import annotations

import errno
import fcntl
import os
import signal
import threading
from collections.abc import Callable

F_SETLEASE = 1024            # linux/fcntl.h (F_LINUX_SPECIFIC_BASE + 0)
F_GETLEASE = 1025

# the open leases: a tuple replaced whole (under _LOCK), so that the signal handler reads it
# without a lock (the main thread it interrupts may hold _LOCK)
_LEASES: tuple[FileLease, ...] = ()
_LOCK = threading.Lock()
_handled = False


class LeaseUnavailable(OSError):
    """This file cannot be leased here (its file system, its owner)."""


def handle_breaks(on: bool = True) -> bool:
    """Install the SIGIO handler that tells each held lease of its break (``on=False``: put
    the default back; take no lease after); False when not on the main thread (Python's
    signal handlers live there)."""
    global _handled
    if threading.current_thread() is not threading.main_thread():
        return False
    signal.signal(signal.SIGIO, _on_signal if on else signal.SIG_DFL)
    _handled = on
    return True


def breaks_handled() -> bool:
    return _handled


def _on_signal(_signum, _frame) -> None:
    # a signal handler: it may interrupt the main thread anywhere, even holding a lock, so it
    # takes none and only tells (on_break sets a flag)
    for lease in [lease for lease in _LEASES if lease.held]:
        try:
            current = fcntl.fcntl(lease.fd, F_GETLEASE)
        except OSError:
            current = fcntl.F_UNLCK
        if current != fcntl.F_RDLCK:       # a break in progress reads as its target, F_UNLCK
            lease.on_break()


class FileLease:
    """A read lease on ``path`` through a descriptor of its own (see the module docstring)."""

    def __init__(self, path: str, on_break: Callable[[], None]):
        self.path = path
        self.on_break = on_break
        self.fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        self.held = False
        global _LEASES
        with _LOCK:
            _LEASES = (*_LEASES, self)

    def take(self) -> bool:
        """Hold the lease; False while another process has the file open for writing."""
        try:
            fcntl.fcntl(self.fd, F_SETLEASE, fcntl.F_RDLCK)
        except OSError as exc:
            if exc.errno in (errno.EAGAIN, errno.EWOULDBLOCK):
                return False
            raise LeaseUnavailable(exc.errno, f"{self.path}: no lease "
                                              f"({os.strerror(exc.errno)})") from None
        # the break's signal goes to this process, whichever thread took the lease
        fcntl.fcntl(self.fd, fcntl.F_SETOWN, os.getpid())
        self.held = True
        return True

    def release(self) -> None:
        if self.held:
            self.held = False
            try:
                fcntl.fcntl(self.fd, F_SETLEASE, fcntl.F_UNLCK)
            except OSError:
                pass                     # broken by the kernel already (lease-break-time)

    def close(self) -> None:
        global _LEASES
        self.release()
        with _LOCK:
            _LEASES = tuple(lease for lease in _LEASES if lease is not self)
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
