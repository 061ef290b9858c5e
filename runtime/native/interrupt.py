"""Ctrl-C around llama.cpp calls that run Python callbacks (``cb_eval``, progress, logging).

An exception raised inside a ctypes callback never reaches the caller: ctypes prints
"Exception ignored on calling ctypes callback function" and the C code goes on (a decode then
finishes its graph, and the generation its remaining tokens). So while such a call runs,
SIGINT only sets a flag; the call is stopped from C (``llama_set_abort_callback`` reads the
flag between graph nodes; the load's progress callback returns false), and KeyboardInterrupt
is raised once the call has returned, at a point where Python can unwind cleanly.

    with interrupt.deferred():          # main thread; a no-op elsewhere
        rc = llama_decode(ctx, batch)
    # leaving the block raises KeyboardInterrupt if Ctrl-C came meanwhile

Outside ``deferred`` blocks Python's own SIGINT behaviour (KeyboardInterrupt at once) holds.
A handler someone else installed (chat's "Ctrl-C stops the reply", uvicorn's) is left alone:
``deferred`` only takes over from Python's default handler.
"""
from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import signal
import threading
from collections.abc import Iterator

# The abort flag, read by C without the GIL: byte 0 is 1 once Ctrl-C came, byte 1 stays 0.
# The abort callback is libc's strlen over it: 0 (go on) or 1 (abort), and a C ``bool``
# return is the low byte of strlen's size_t. No Python runs per graph node.
_FLAG = (ctypes.c_char * 2)()
_depth = 0                      # nesting of deferred() blocks on the main thread
_previous = None                # the handler deferred() replaced
_abort_fn = None


def requested() -> bool:
    """Ctrl-C arrived inside the current deferred block."""
    return _FLAG[0] != b"\x00"


def _on_sigint(_signum, _frame) -> None:
    _FLAG[0] = b"\x01"


def _can_take_over() -> bool:
    return (threading.current_thread() is threading.main_thread()
            and signal.getsignal(signal.SIGINT) in (signal.default_int_handler, _on_sigint))


@contextlib.contextmanager
def deferred() -> Iterator[None]:
    """Hold Ctrl-C while inside; raise KeyboardInterrupt on leaving if it came (main thread
    with Python's default handler only; elsewhere a plain block)."""
    global _depth, _previous
    if not _can_take_over():
        yield
        return
    if _depth == 0:
        _FLAG[0] = b"\x00"
        _previous = signal.signal(signal.SIGINT, _on_sigint)
    _depth += 1
    try:
        yield
    finally:
        _depth -= 1
        if _depth == 0:
            signal.signal(signal.SIGINT, _previous)
            _previous = None
            if requested():
                _FLAG[0] = b"\x00"
                raise KeyboardInterrupt   # replaces an error the abort itself caused


def abort_callback(bindings: object) -> tuple[object, int]:
    """(callback, user data) for ``llama_set_abort_callback`` of the llama.cpp ``bindings``:
    true once Ctrl-C came inside a deferred block. Keep nothing alive: both live as long as
    this module."""
    global _abort_fn
    if _abort_fn is None:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        address = ctypes.cast(libc.strlen, ctypes.c_void_p).value
        _abort_fn = bindings.ggml_abort_callback(address)
    return _abort_fn, ctypes.addressof(_FLAG)
