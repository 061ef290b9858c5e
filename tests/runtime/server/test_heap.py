"""The server's glibc malloc settings (runtime/server/heap.py): a big block is mmapped, so
given back to the system when freed, however many big blocks were freed before; glibc's
default raises the threshold at the first free and carves later ones from a heap whose
pages stay (the server's RSS crept up under scripts/soak.py while the bytes in use did not)."""
from __future__ import annotations

import ctypes
import os
import subprocess
import sys

import pytest

from tests.runtime.server.conftest import REPO_ROOT

_PROBE = """
import ctypes, sys
from runtime.server.heap import MMAP_THRESHOLD, tune_for_serving

class MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd",
                "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]

libc = ctypes.CDLL(None)
libc.mallinfo2.restype = MallInfo2
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
if sys.argv[1] == "tuned":
    assert tune_for_serving()
libc.free(libc.malloc(MMAP_THRESHOLD))  # a first big block, freed (the default's cue)
before = libc.mallinfo2().hblks          # mmapped blocks (Python's own among them)
block = libc.malloc(MMAP_THRESHOLD)     # the next one: mmapped or carved from a heap?
print(libc.mallinfo2().hblks - before)
libc.free(block)
"""


def _glibc() -> bool:
    try:
        return hasattr(ctypes.CDLL(None), "mallinfo2")
    except OSError:
        return False


@pytest.mark.skipif(not _glibc(), reason="glibc's allocator (mallopt, mallinfo2)")
def test_a_big_block_is_given_back_after_others_were_freed():
    def mmapped(mode: str, **env: str) -> int:
        out = subprocess.run([sys.executable, "-c", _PROBE, mode], cwd=REPO_ROOT, check=True,
                             capture_output=True, text=True,
                             env={k: v for k, v in os.environ.items()
                                  if not k.startswith("MALLOC_")} | env).stdout
        return int(out)

    assert mmapped("default") == 0       # glibc's dynamic threshold: from a heap
    assert mmapped("tuned") == 1         # the server's: mmapped, unmapped at free
    # an operator's own threshold (32 MiB here) is left as set
    assert mmapped("tuned", MALLOC_MMAP_THRESHOLD_=str(32 << 20)) == 0
