"""The host-RAM expert tier: the residency manager's transport for device ``cpu`` and a
routing observer that pages each layer's experts in before its expert matmul runs.

Flow per layer and ubatch (``on_route``, synchronous between router and matmul):
  1. the previous layer's lease is released and its transient experts' pages dropped (its
     matmul has run: the graph is sequential);
  2. ``manager.access_layer("cpu", ...)`` decides hits, admissions (resident at once; their
     reads handed to ``submit``) and transient uses;
  3. the layer's experts that are not in the page cache are read in parallel: demand
     admissions (their tickets, on the pager's pool), transient uses, queued prefetches, and
     manager hits the kernel reclaimed (a one-page mincore probe per hit finds them; then one
     mincore over the layer). We wait for those reads, then return and the matmul runs on
     resident pages.

Prefetch tickets (the manager's prefetch policies) stream on the background lane behind demand
reads. After a cold page cache the refiller reads the held experts back (``refill.py``); when
the budget has room for every expert, everything not yet resident is prefetched (``fill_spare``).

The tier keeps its own record of which experts hold pages (``held``) so that dropping one
expert never drops a page shared with a neighbour that stays, without calling back into the
manager (which may call ``drop`` with its lock held).
"""
from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future

import numpy as np

from runtime.ramtier.lane import BackgroundLane
from runtime.ramtier.layout import ExpertLayout
from runtime.ramtier.pager import PageInStats, Pager
from runtime.ramtier.refill import Refiller
from runtime.ramtier.telemetry import ResidencyTruth, TierStats, prometheus_text
from runtime.ramtier import vm
from runtime.residency.types import ExpertKey, LayerAccess, Phase, Ticket

log = logging.getLogger("moe_offload.ramtier")

DEVICE = "cpu"


class RamTier:
    """Transport (device ``cpu``) + RouteObserver over llama.cpp's mapping of the model."""

    inline = True       # the manager decides at once; reads follow (see submit)

    def __init__(self, manager, layout: ExpertLayout, pager: Pager, *, budget_bytes: int,
                 mlock: bool = False, refill: bool = True):
        self.manager = manager
        self.layout = layout
        self.pager = pager
        self.budget_bytes = budget_bytes
        self.mlock = mlock
        self.notices: list[str] = []
        self._warned: set[str] = set()
        self._guard = threading.Lock()           # short: sets and counters, never across I/O
        self._held: set[ExpertKey] = set()       # read in and still resident (pages may stay)
        self._inflight: dict[int, tuple[Ticket, Future]] = {}   # ticket id -> (ticket, done)
        self._evicted_in_flight: set[ExpertKey] = set()   # evicted while its read ran
        self._current: LayerAccess | None = None
        self._current_keys: frozenset[ExpertKey] = frozenset()  # needed by the running layer
        self._transient: tuple[ExpertKey, ...] = ()
        self._routes = self._paged = self._reclaimed = self._prefetched = 0
        self._dropped = self._errors = 0
        self._wait_s = 0.0
        self.n_layer = 1 + max((k.layer for k in layout.keys), default=0)
        self.refiller = Refiller(self) if refill else None
        self.lane = BackgroundLane(pager)

    # ---- Transport ----------------------------------------------------------------------
    def bind(self, manager) -> None:
        self.manager = manager

    def submit(self, ticket: Ticket) -> None:
        """Page ``ticket.key`` in (the manager holds it resident already); a read error makes
        it leave the manager (``transfer_failed``)."""
        done: Future = Future()
        with self._guard:
            self._inflight[ticket.id] = (ticket, done)
            self._evicted_in_flight.discard(ticket.key)
        spans = list(self.layout.ranges(ticket.key))
        # demand admissions on the pager's pool (the hook waits for them); prefetches behind
        # them on the background lane
        read = self.lane.submit(spans) if ticket.prefetch else self.pager.page_in_async(spans)

        def finished(fut: Future) -> None:
            stats: PageInStats = fut.result()
            key = ticket.key
            with self._guard:
                self._inflight.pop(ticket.id, None)
                evicted = key in self._evicted_in_flight
                self._evicted_in_flight.discard(key)
                if stats.error is None and not evicted:
                    self._held.add(key)
                if stats.error is None:
                    if ticket.prefetch:
                        self._prefetched += stats.bytes
                    else:
                        self._paged += stats.bytes
                else:
                    self._errors += 1
            try:
                if stats.error is not None:
                    log.warning("page-in of %s failed: %s", key, stats.error)
                    if not evicted:
                        self.manager.transfer_failed(ticket)
                elif evicted:                  # its pages came in after it left: drop them
                    self.drop_pages(key)
                else:
                    self._lock_if_allowed(key)
            finally:
                done.set_result(stats)

        read.add_done_callback(finished)

    def drop(self, device: str, key: ExpertKey) -> None:
        """The manager evicted ``key``: drop its pages that no held expert shares."""
        with self._guard:
            self._held.discard(key)
            reading = {t.key for t, _ in self._inflight.values()}
            if key in reading:                 # dropped when its read lands
                self._evicted_in_flight.add(key)
            keep = set(self._held) | set(self._current_keys) | reading
            self._dropped += 1
        if key in keep:
            return
        self.pager.drop(self.layout.droppable(key, keep.__contains__))

    def inflight_bytes(self) -> int:
        """Bytes of transfers in flight (read, or being read, while their victims stay).

        A bound on what the tier holds: the manager decides inline (a transfer's victims
        leave before its read starts, and the expert read is already inside the budget), so
        expert bytes resident in the page cache stay <= budget + the running layer's experts
        + ``inflight_bytes()``, the last term being conservative. After a cold page cache the
        refiller's reads count too: an expert evicted while its refill read ran is dropped
        again as soon as that read is done (refill.py)."""
        with self._guard:
            transfers = sum(t.bytes for t, _ in self._inflight.values())
        return transfers + (self.refiller.in_flight_bytes if self.refiller is not None else 0)

    # ---- queries for the refiller -------------------------------------------------------
    def held_keys(self) -> list[ExpertKey]:
        with self._guard:
            return list(self._held)

    def is_held(self, key: ExpertKey) -> bool:
        with self._guard:
            return key in self._held

    def drop_pages(self, key: ExpertKey) -> None:
        """Drop ``key``'s pages unless it is held, in flight or in use by the running layer."""
        with self._guard:
            keep = set(self._held) | set(self._current_keys) | \
                {t.key for t, _ in self._inflight.values()}
        if key not in keep:
            self.pager.drop(self.layout.droppable(key, keep.__contains__))

    # ---- RouteObserver ------------------------------------------------------------------
    def on_route(self, event) -> None:
        """Page in the layer's experts before its matmul; never raises into the graph."""
        try:
            self._finish_layer()
            experts = np.asarray(event.experts).reshape(-1)
            access = self.manager.access_layer(DEVICE, event.layer, experts, event.phase)
            keys = frozenset(ExpertKey(event.layer, int(e)) for e in np.unique(experts))
            with self._guard:
                self._routes += 1
                self._current, self._current_keys = access, keys
                self._transient = tuple(access.transient)
            self._bring_in(keys, access)
        except Exception as exc:  # noqa: BLE001 - the matmul still runs: pages fault in
            self._warn_once(f"ram tier: {type(exc).__name__}: {exc} (layer "
                            f"{getattr(event, 'layer', '?')}; pages fault in as with plain mmap)")

    def on_batch_end(self, phase: Phase, n_tokens: int) -> None:
        """The batch's last matmul has run: release the lease and drop transients."""
        try:
            self._finish_layer()
        except Exception as exc:  # noqa: BLE001
            self._warn_once(f"ram tier: at batch end: {type(exc).__name__}: {exc}")

    # ---- internals ----------------------------------------------------------------------
    def _bring_in(self, keys: frozenset[ExpertKey], access: LayerAccess) -> None:
        t0 = time.perf_counter()
        with self._guard:
            waits = [f for t, f in self._inflight.values() if t.key in keys and not t.prefetch]
            pending = {t.key for t, _ in self._inflight.values() if t.key in keys}
            queued = {t.key for t, _ in self._inflight.values() if t.key in keys and t.prefetch}
        spans: list[tuple[int, int]] = []
        for key in queued:          # a prefetch may sit far back in the lane: read it now
            spans.extend(self.layout.ranges(key))
        for key in access.transient:                  # used once: read, no check needed
            if key not in pending:
                spans.extend(self.layout.ranges(key))
        hits = sorted(keys - pending - set(access.transient) - set(access.admitted))
        reclaimed = 0
        if hits and not self._probe(hits):            # the kernel took some of them back
            pages = self._layer_pages(hits)
            for key in hits:
                missing = self.missing_spans(key, pages)
                spans.extend(missing)
                reclaimed += sum(n for _, n in missing)
        if reclaimed and self.refiller is not None:
            self.refiller.maybe_start(min(k.layer for k in keys), self.n_layer)
        stats = self.pager.page_in(spans) if spans else PageInStats(0, 0.0)
        for fut in waits:
            fut.result()
        with self._guard:
            self._paged += stats.bytes
            self._reclaimed += reclaimed
            self._wait_s += time.perf_counter() - t0
            if stats.error:
                self._errors += 1

    def _probe(self, keys: list[ExpertKey]) -> bool:
        """Cheap residency probe of manager hits: the first page of each key's first range
        (one small mincore each). A miss triggers the full check of the layer."""
        mapping = self.pager.mapping
        try:
            for key in keys:
                offset, _ = self.layout.ranges(key)[0]
                pieces = mapping.address_spans(offset, 1)
                if not pieces or not vm.mincore(pieces[0][0], 1)[0]:
                    return False
        except OSError:
            mapping.refresh()
            return False
        return True

    def _layer_pages(self, keys: list[ExpertKey]) -> tuple[int, np.ndarray] | None:
        """One ``mincore`` over the span of ``keys`` (a layer's experts sit together):
        (first page, (n_pages,) bool), or None when it cannot be read."""
        if not keys:
            return None
        offset, length = self.layout.span_of(keys)
        try:
            return offset // vm.PAGE_SIZE, self.pager.mapping.resident_span(offset, length)
        except (OSError, ValueError):     # a copy went away (a reader's np.memmap was freed)
            self.pager.mapping.refresh()
            return None

    def missing_spans(self, key: ExpertKey, pages: tuple[int, np.ndarray] | None = None
                      ) -> list[tuple[int, int]]:
        """The ranges of ``key`` not wholly in the page cache (mincore), to read now.
        ``pages``: a ``_layer_pages`` result covering ``key`` (else one mincore per range)."""
        if pages is None:
            pages = self._layer_pages([key])
            if pages is None:
                return list(self.layout.ranges(key))
        first, vec = pages
        out = []
        for offset, length in self.layout.ranges(key):
            lo = offset // vm.PAGE_SIZE - first
            hi = (offset + length - 1) // vm.PAGE_SIZE - first + 1
            if not vec[lo:hi].all():
                out.append((offset, length))
        return out

    def _finish_layer(self) -> None:
        with self._guard:
            access, transient = self._current, self._transient
            self._current, self._current_keys, self._transient = None, frozenset(), ()
            keep = set(self._held) | {t.key for t, _ in self._inflight.values()}
        if access is not None:
            self.manager.release(access)
        for key in transient:
            if key not in keep:
                self.pager.drop(self.layout.droppable(key, keep.__contains__))

    def _warn_once(self, message: str) -> None:
        with self._guard:
            self._errors += 1
            if message in self._warned:
                return
            self._warned.add(message)
        self.notices.append(message)
        log.warning("%s", message)

    def _lock_if_allowed(self, key: ExpertKey) -> None:
        if not self.mlock:
            return
        nbytes = self.layout.nbytes(key)
        limits = vm.memlock_limits()
        if not limits.allows(self.pager.locked_bytes + nbytes):
            self._disable_mlock(f"mlock of hot experts disabled: {limits.describe()} is below "
                                f"the {self.budget_bytes >> 20} MiB cpu budget")
            return
        try:
            for offset, length in self.layout.ranges(key):
                self.pager.lock(offset, length)
        except OSError as err:
            self._disable_mlock(f"mlock of hot experts disabled: {err.strerror} "
                                f"({limits.describe()})")

    def _disable_mlock(self, message: str) -> None:
        self.mlock = False
        self.pager.unlock_all()
        self.notices.append(message)
        log.warning("%s", message)

    # ---- telemetry ----------------------------------------------------------------------
    def stats(self) -> TierStats:
        with self._guard:
            return TierStats(self._routes, self._paged, self._reclaimed, self._wait_s,
                             self._prefetched, self._dropped, self.pager.locked_bytes,
                             self._errors,
                             self.refiller.refilled_bytes if self.refiller else 0)

    def truth(self) -> ResidencyTruth:
        """Manager view vs ``mincore`` (one mincore pass over the mapping: ~1 ms per GiB)."""
        resident = self.layout.resident_bytes(self.pager.mapping.resident_pages())
        manager_view = self.manager.snapshot().device(DEVICE).resident_bytes
        return ResidencyTruth(int(manager_view), int(resident.sum()), self.budget_bytes)

    def to_prometheus(self) -> str:
        """Prometheus text: resident bytes by view (manager / mincore), budget, counters."""
        return prometheus_text(self.truth(), self.stats())

    def drop_unheld(self) -> None:
        """Drop the pages of every expert not held (at attach: llama.cpp populated them all)."""
        with self._guard:
            keep = set(self._held)
        spans = []
        for key in self.layout.keys:
            if key not in keep:
                spans.extend(self.layout.droppable(key, keep.__contains__))
        self.pager.drop(_merge(spans))

    def fill_spare(self) -> int:
        """When the budget has room for every expert not yet resident, prefetch them all
        (layer order) through the manager; nothing to choose, so no policy is overridden.
        Returns how many tickets were issued."""
        device = self.manager.snapshot().device(DEVICE)
        if device.capacity_bytes is None:
            return 0
        free = device.capacity_bytes - device.resident_bytes - device.pending_bytes
        absent = []
        for layer in sorted({k.layer for k in self.layout.keys}):
            mask = self.manager.resident_mask(DEVICE, layer)
            absent.extend(k for k in self.layout.keys if k.layer == layer and not mask[k.expert])
        with self._guard:
            busy = {t.key for t, _ in self._inflight.values()}
        absent = [k for k in absent if k not in busy]
        if not absent or sum(self.layout.nbytes(k) for k in absent) > free:
            return 0
        return len(self.manager.prefetch(DEVICE, absent, Phase.DECODE))

    def scrub(self) -> int:
        """Drop resident pages of experts that are not held, in flight or in use (mincore
        finds them); returns how many experts were scrubbed."""
        resident = self.layout.resident_bytes(self.pager.mapping.resident_pages())
        with self._guard:
            keep = set(self._held) | set(self._current_keys) | \
                {t.key for t, _ in self._inflight.values()}
        spans, n = [], 0
        for key in self.layout.keys:
            if key not in keep and resident[self.layout.key_index(key)]:
                spans.extend(self.layout.droppable(key, keep.__contains__))
                n += 1
        self.pager.drop(_merge(spans))
        return n

    def close(self) -> None:
        with self._guard:
            waits = [f for _, f in self._inflight.values()]
        for fut in waits:
            fut.result()
        if self.refiller is not None:
            self.refiller.close()
        self.lane.close()
        self.pager.close()


def _merge(spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Coalesce touching page-aligned spans (fewer syscalls)."""
    out: list[list[int]] = []
    for offset, length in sorted(spans):
        if out and offset <= out[-1][0] + out[-1][1]:
            out[-1][1] = max(out[-1][1], offset + length - out[-1][0])
        else:
            out.append([offset, length])
    return [(o, n) for o, n in out]
