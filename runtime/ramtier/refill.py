"""Background refill: after the page cache lost most of the experts the manager holds in RAM
(a cold cache: the file's pages were dropped, the machine was under pressure, a restart), read
them back ahead of use, next layers first, so decode does not wait on each layer's reads.
Demand reads still come first: the refill reads one expert at a time (the pager's explicit
preads, its chunks in parallel), and a layer's own misses are read by the tier as usual.

A mechanism, not a policy: it restores exactly the manager's resident set. It starts only when
more than ``COLD_FRACTION`` of the held bytes are gone (a few experts reclaimed under steady
memory pressure are left to demand reads: refilling would fight the kernel), at most once per
``MIN_INTERVAL_S``. Dense weights are read first (see ``_refill``); at the end a scrub
drops every page of an expert that is not held (evicted while its refill read ran, or pulled
in by the kernel's read-around of a dense fault).
"""
from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

COLD_FRACTION = 0.5     # share of held bytes missing that counts as a cold cache
MIN_INTERVAL_S = 1.0    # between two cold checks (each is a mincore pass over the file)


class Refiller:
    """Owned by a ``RamTier``. Reads one expert at a time (explicit preads, its chunks on the
    pager's threads) from one thread, in refill order."""

    def __init__(self, tier):
        self.tier = tier
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ramtier-refill")
        self._guard = threading.Lock()
        self._pending = 0
        self._last_check = 0.0
        self.runs = 0
        self.refilled_bytes = 0
        self.in_flight_bytes = 0   # refill reads queued and not yet settled (see _settle)

    @property
    def active(self) -> bool:
        return self._pending > 0

    def maybe_start(self, layer: int, n_layer: int) -> bool:
        """A held expert was found reclaimed at ``layer``: refill if the cache went cold."""
        now = time.monotonic()
        with self._guard:
            if self._pending or now - self._last_check < MIN_INTERVAL_S:
                return False
            self._last_check = now
        tier = self.tier
        held = tier.held_keys()
        if not held:
            return False
        resident = tier.layout.resident_bytes(tier.pager.mapping.resident_pages())
        sizes = {k: tier.layout.nbytes(k) for k in held}
        missing = [k for k in held if resident[tier.layout.key_index(k)] < sizes[k]]
        if sum(sizes[k] for k in missing) <= COLD_FRACTION * sum(sizes.values()):
            return False
        missing.sort(key=lambda k: ((k.layer - layer - 1) % n_layer, k.expert))
        with self._guard:
            self._pending = 1
            self.runs += 1
        self._pool.submit(self._refill, missing)
        return True

    def _refill(self, keys) -> None:
        """Read each held expert's missing ranges in order, one expert at a time, so a
        layer's demand reads never queue behind more than one expert's."""
        tier = self.tier
        try:
            # dense weights first: a fault on a dropped dense page reads around it (up to
            # read_ahead_kb) into neighbouring experts nobody asked for
            tier.pager.page_in(tier.layout.gaps(tier.pager.mapping.file_bytes))
            for key in keys:
                if not tier.is_held(key):
                    continue
                spans = tier.missing_spans(key)
                if not spans:
                    continue
                nbytes = sum(m for _, m in spans)
                with self._guard:             # counted before the reads start
                    self.in_flight_bytes += nbytes
                try:
                    stats = tier.pager.page_in(spans)
                    with self._guard:
                        self.refilled_bytes += nbytes if stats.error is None else 0
                    if not tier.is_held(key):  # evicted while its reads ran: drop them now
                        tier.drop_pages(key)
                finally:
                    with self._guard:
                        self.in_flight_bytes -= nbytes
            tier.scrub()                       # drop what faults pulled in meanwhile
            tier.request_fill()                # room for everything: bring the rest too
        except OSError:
            pass                               # demand reads bring what is needed
        finally:
            with self._guard:
                self._pending = 0

    def close(self) -> None:
        self._pool.shutdown(wait=True)
