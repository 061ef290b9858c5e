"""glibc malloc settings for a server that runs for days: its resident memory follows what it
holds, instead of the most it ever held at once in each of its threads' heaps.

With glibc's defaults each thread that allocates gets a heap of its own (up to 8 per core:
the decode thread, the side pool, anyio's workers, llama.cpp's), and a block of 128 KiB or
more is mmapped only until the first such block is freed: the threshold then rises to that
block's size (up to 32 MiB), so later big transient blocks (a vocabulary-sized candidate
array per sampled token, a slot's state, a large request body) are carved from those heaps
and their pages stay when freed. Under scripts/soak.py's mix the server's RSS rose 5-9% past
its warm-up that way while the bytes in use stayed flat (mallinfo2); with two heaps and a
fixed threshold it stayed within +1.4% in 15 minutes and +5% in 30, a slow climb of about
0.3 MiB a minute left (docs/benchmarks/2026-12-07-soak-memory.md). The price: a block of
128 KiB or more costs an mmap and its page faults each time it is made (about 1 ms for a
152k-token vocabulary's candidate array in a grammar or logprobs request: some 1% of a
real-scale decode step).

``tune_for_serving()`` sets both through ``mallopt`` before the server starts its threads; one
the operator set already (``MALLOC_ARENA_MAX``, ``MALLOC_MMAP_THRESHOLD_``, or its name in
``GLIBC_TUNABLES``) is left as set; on a C library without ``mallopt`` (musl, macOS) it does
nothing.
"""
from __future__ import annotations

import ctypes
import logging
import os

log = logging.getLogger("moe_offload.server")

M_MMAP_THRESHOLD = -3        # mallopt parameters (glibc malloc.h)
M_ARENA_MAX = -8
MMAP_THRESHOLD = 128 << 10   # bytes: a block this big or bigger is mmapped, freed to the system
ARENAS = 2                   # heaps shared by every thread (glibc's default: 8 per core)


# each setting: (mallopt parameter, value, its environment variable, its glibc tunable)
_SETTINGS = ((M_MMAP_THRESHOLD, MMAP_THRESHOLD, "MALLOC_MMAP_THRESHOLD_", "mmap_threshold"),
             (M_ARENA_MAX, ARENAS, "MALLOC_ARENA_MAX", "arena_max"))


def tune_for_serving() -> bool:
    """Fix the mmap threshold and cap the heaps (glibc), each unless the environment set it;
    True when every setting is the server's or the operator's."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):          # not glibc: its allocator, its own behaviour
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    tunables = os.environ.get("GLIBC_TUNABLES", "")
    done = True
    for param, value, variable, tunable in _SETTINGS:
        if variable in os.environ or f"glibc.malloc.{tunable}=" in tunables:
            continue                           # the operator's choice
        if not mallopt(param, value):
            log.debug("mallopt(%d, %d) refused; glibc's default stays", param, value)
            done = False
    return done
