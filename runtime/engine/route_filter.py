"""A C pre-filter in front of the Python ``cb_eval``: the scheduler asks about EVERY graph node
(~45 per MoE layer per token); a ctypes callback costs ~2 us per call even when it answers
"no". This 20-line C function answers "no" itself unless the node's name starts with one of
the given prefixes and is not a name ggml derived from another (those hold a space: "x
(reshaped)"; the patched graph's cache path makes several per layer from the router's nodes),
and only then calls the Python callback. Compiled once with the system C
compiler into the cache directory (``cc -O2 -shared``, no Python headers, loaded by ctypes);
without a compiler the hook falls back to the pure-Python callback (same results, slower).
``MOE_OFFLOAD_PURE_PYTHON_HOOK=1`` forces the fallback.
"""
from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from runtime.cache import cache_dir

log = logging.getLogger("moe_offload.engine")

MAX_PREFIXES = 16
PREFIX_BYTES = 32

C_SOURCE = r"""
#include <stdbool.h>
#include <stddef.h>
#include <string.h>

typedef bool (*eval_cb)(void *tensor, bool ask, void *user_data);

struct route_filter {
    eval_cb cb;                  /* the Python callback */
    void *cb_user_data;
    size_t name_offset;          /* offsetof(struct ggml_tensor, name) */
    int n_prefixes;
    char prefixes[16][32];       /* NUL-terminated */
};

bool moe_route_filter(void *tensor, bool ask, void *user_data) {
    const struct route_filter *f = (const struct route_filter *)user_data;
    const char *name = (const char *)tensor + f->name_offset;
    /* names ggml derives ("ffn_moe_topk-3 (reshaped)", "... (cont)") are never wanted */
    if (memchr(name, ' ', strnlen(name, 64)) != NULL) {
        return false;
    }
    for (int i = 0; i < f->n_prefixes; i++) {
        if (strncmp(name, f->prefixes[i], strlen(f->prefixes[i])) == 0) {
            return f->cb(tensor, ask, f->cb_user_data);
        }
    }
    return false;
}
"""


class FilterState(ctypes.Structure):
    _fields_ = [("cb", ctypes.c_void_p), ("cb_user_data", ctypes.c_void_p),
                ("name_offset", ctypes.c_size_t), ("n_prefixes", ctypes.c_int),
                ("prefixes", (ctypes.c_char * PREFIX_BYTES) * MAX_PREFIXES)]


_lib: ctypes.CDLL | None = None
_tried = False


def load_filter_library() -> ctypes.CDLL | None:
    """The compiled filter (built on first use), or None when it cannot be built."""
    global _lib, _tried
    if _tried:
        return _lib
    _tried = True
    if os.environ.get("MOE_OFFLOAD_PURE_PYTHON_HOOK") == "1":
        return None
    digest = hashlib.sha256(C_SOURCE.encode()).hexdigest()[:16]
    path = cache_dir("engine") / f"route_filter-{digest}.so"
    try:
        if not path.is_file():
            _compile(path)
        _lib = ctypes.CDLL(str(path))
    except (OSError, subprocess.SubprocessError, FileNotFoundError) as exc:
        log.info("routing hook: C pre-filter unavailable (%s); using the Python callback", exc)
        _lib = None
    return _lib


def _compile(path: Path) -> None:
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise FileNotFoundError("no C compiler (cc/gcc) on PATH")
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
        src = Path(tmp) / "route_filter.c"
        src.write_text(C_SOURCE)
        out = Path(tmp) / path.name
        subprocess.run([cc, "-O2", "-shared", "-fPIC", "-o", str(out), str(src)], check=True,
                       capture_output=True, timeout=120)
        os.replace(out, path)      # atomic: concurrent builders never see a partial file


class RouteFilter:
    """A C ``cb_eval`` that forwards nodes named ``prefix*`` to ``python_callback``.
    Keep this object alive as long as the llama context that uses it."""

    def __init__(self, lib: ctypes.CDLL, python_callback, prefixes: list[bytes],
                 name_offset: int, callback_type):
        if len(prefixes) > MAX_PREFIXES or any(len(p) >= PREFIX_BYTES for p in prefixes):
            raise ValueError("too many or too long prefixes for the route filter")
        self._python_callback = python_callback      # keep the ctypes thunk alive
        self.state = FilterState()
        self.state.cb = ctypes.cast(python_callback, ctypes.c_void_p).value
        self.state.cb_user_data = None
        self.state.name_offset = name_offset
        self.state.n_prefixes = len(prefixes)
        for i, p in enumerate(prefixes):
            self.state.prefixes[i].value = p
        self.prefixes = list(prefixes)
        address = ctypes.cast(lib.moe_route_filter, ctypes.c_void_p).value
        self.callback = callback_type(address)
        self.user_data = ctypes.cast(ctypes.pointer(self.state), ctypes.c_void_p)

    def add_prefix(self, prefix: bytes) -> None:
        """Also forward nodes named ``prefix*`` (set between decode calls)."""
        if prefix in self.prefixes:
            return
        if len(self.prefixes) >= MAX_PREFIXES or len(prefix) >= PREFIX_BYTES:
            raise ValueError(f"route filter: no room for prefix {prefix!r}")
        self.state.prefixes[len(self.prefixes)].value = prefix
        self.prefixes.append(prefix)
        self.state.n_prefixes = len(self.prefixes)

    def set_prefixes(self, prefixes: list[bytes]) -> None:
        """Replace the forwarded prefixes (between decode calls)."""
        if len(prefixes) > MAX_PREFIXES or any(len(p) >= PREFIX_BYTES for p in prefixes):
            raise ValueError("too many or too long prefixes for the route filter")
        self.state.n_prefixes = 0
        for i, p in enumerate(prefixes):
            self.state.prefixes[i].value = p
        self.prefixes = list(prefixes)
        self.state.n_prefixes = len(prefixes)
