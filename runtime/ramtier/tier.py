"""The host-RAM expert tier: the residency manager's transport for device ``cpu`` and a
routing observer that pages each layer's experts in before its expert matmul runs.

Per layer and ubatch the work is C (tier_io.c, stepped by the routing hook's native mode, or
by ``on_route`` in the reference hook, hook/reference.py; no Python call per layer-step live):
  1. the previous layer's lease ends and its transient experts' pages are dropped (its matmul
     has run: the graph is sequential);
  2. the cpu device's residency core decides hits, admissions (resident at once) and
     transient uses; evicted experts' pages leave at once;
  3. the layer's experts that are not in the page cache are read in parallel (``threads`` in
     flight): admissions, transient uses, and hits the kernel reclaimed (a one-page mincore
     probe per hit; then mincore over each hit's ranges); then the matmul runs on resident
     pages. A failed read fails the decode (RouteCaptureError).

Prefetches the core issues in a layer-step are queued there and then (MADV_WILLNEED, no wait);
their first use waits for what is still coming. Once per batch (``after_batch``, Python) the C
side's events are drained (mlock follows admissions and drops). The first layer of a batch
whose hits were found reclaimed calls Python (a rare event), which starts the background
refill (``refill.py``) after a cold page cache; when the budget has room for every expert,
everything not yet resident is prefetched (``fill_spare``).

Which experts hold pages is one byte per flat key (``TierIO.held``), shared with C, so that
dropping one expert never drops a page shared with a neighbour that stays, without calling
back into the manager (which may call ``drop`` with its lock held).
"""
from __future__ import annotations

import logging
import threading
from concurrent.futures import Future

import numpy as np

from runtime.ramtier.lane import BackgroundLane
from runtime.ramtier.layout import ExpertLayout
from runtime.ramtier.pager import PageInStats, Pager
from runtime.ramtier.refill import Refiller
from runtime.ramtier.telemetry import ResidencyTruth, TierStats, prometheus_text
from runtime.ramtier.tier_io import EV_ADMIT, EV_DROP, TierIO
from runtime.ramtier import vm
from runtime.residency.types import ExpertKey, Phase, Ticket

log = logging.getLogger("moe_offload.ramtier")

DEVICE = "cpu"


class RamTier:
    """Transport (device ``cpu``) + RouteObserver over llama.cpp's mapping of the model."""


    def __init__(self, manager, layout: ExpertLayout, pager: Pager, *, budget_bytes: int,
                 mlock: bool = False, refill: bool = True):
        self.manager = manager
        self.layout = layout
        self.pager = pager
        self.budget_bytes = budget_bytes
        self.notices: list[str] = []
        self._warned: set[str] = set()
        self._guard = threading.Lock()           # short: dicts and counters, never across I/O
        self._inflight: dict[int, tuple[Ticket, Future]] = {}   # ticket id -> (ticket, done)
        self._reads_of: dict[int, int] = {}      # flat key -> its tickets in flight (busy)
        self._failed: list[Ticket] = []          # background reads that failed (batch end)
        self._want_fill = False                  # the refiller asked for fill_spare
        self._regions_stale = False              # the mapping was re-read since C last saw it
        self._paged = self._prefetched = self._dropped = self._errors = 0
        self.n_layer = 1 + max((k.layer for k in layout.keys), default=0)
        # the native core of "cpu" (attach_to declines a manager on the reference core)
        self.io = TierIO(manager.core_handle(DEVICE), layout, pager.mapping,
                         n_layer=self.n_layer, n_expert=manager.n_expert, fd=pager.fileno(),
                         threads=pager.threads)
        self._mlock = False
        self.mlock = mlock
        self.refiller = Refiller(self) if refill else None
        if self.refiller is not None:
            self.io.on_reclaim(self._reclaimed_at)
        self.lane = BackgroundLane(pager)

    @property
    def native_handle(self):
        """The C tier the routing hook steps per MoE layer-step (native mode)."""
        return self.io.native_handle

    @property
    def mlock(self) -> bool:
        return self._mlock

    @mlock.setter
    def mlock(self, on: bool) -> None:
        self._mlock = bool(on)
        self.io.set_mlock(self._mlock)

    # ---- Transport ----------------------------------------------------------------------
    def bind(self, manager) -> None:
        self.manager = manager

    def submit(self, ticket: Ticket) -> None:
        """Page ``ticket.key`` in on the background lane (the manager holds it resident
        already; a layer that needs it first reads it itself). A read error makes it leave
        the manager (``transfer_failed``, at the next batch end)."""
        flat = self.io.flat(ticket.key)
        done: Future = Future()
        with self._guard:
            self._inflight[ticket.id] = (ticket, done)
            self._reads_of[flat] = self._reads_of.get(flat, 0) + 1
            self.io.busy[flat] = 1
        read = self.lane.submit(list(self.layout.ranges(ticket.key)))

        def finished(fut: Future) -> None:
            stats: PageInStats = fut.result()
            key = ticket.key
            with self._guard:
                self._inflight.pop(ticket.id, None)
                self._reads_of[flat] -= 1
                if not self._reads_of[flat]:
                    del self._reads_of[flat]
                    self.io.busy[flat] = 0
                if stats.error is None:
                    if ticket.prefetch:
                        self._prefetched += stats.bytes
                    else:
                        self._paged += stats.bytes
                else:
                    self._errors += 1
                    self._failed.append(ticket)
            try:
                if stats.error is not None:
                    log.warning("page-in of %s failed: %s", key, stats.error)
                elif self.manager.is_resident(DEVICE, key):
                    self.io.held[flat] = 1
                    self._lock_if_allowed(key)
                else:                          # evicted while its read ran: drop its pages
                    self.drop_pages(key)
            finally:
                done.set_result(stats)

        read.add_done_callback(finished)

    def drop(self, device: str, key: ExpertKey) -> None:
        """The manager evicted ``key``: drop its pages that no held expert shares (a key
        being read is dropped when its read lands)."""
        flat = self.io.flat(key)
        self.io.held[flat] = 0
        with self._guard:
            self._dropped += 1
        self.io.drop(flat)
        self._unlock(key)

    def inflight_bytes(self) -> int:
        """Bytes of transfers in flight (read, or being read, while their victims stay).

        A bound on what the tier holds: the manager decides inline (a transfer's victims
        leave before its read starts, and the expert read is already inside its capacity),
        so expert bytes resident in the page cache stay <= capacity + the running layer's
        transient uses + ``inflight_bytes()``, the last term being conservative (it counts
        the evicted experts whose pages the drop thread has yet to drop). With a one-use room
        (a budget below every expert: ``split_budget``) the layer-steps keep the last two
        terms' step part within the room, so <= ``budget_bytes``. After a cold page cache
        the refiller's reads count too: an expert evicted while its refill read ran is
        dropped again as soon as that read is done (refill.py)."""
        with self._guard:
            transfers = sum(t.bytes for t, _ in self._inflight.values())
        return transfers + (self.refiller.in_flight_bytes if self.refiller is not None else 0) \
            + self.io.pending_drop_bytes()

    # ---- queries for the refiller -------------------------------------------------------
    def held_keys(self) -> list[ExpertKey]:
        ne = self.io.n_expert
        return [ExpertKey(int(f) // ne, int(f) % ne) for f in np.flatnonzero(self.io.held)]

    def is_held(self, key: ExpertKey) -> bool:
        return bool(self.io.held[self.io.flat(key)])

    def drop_pages(self, key: ExpertKey) -> None:
        """Drop ``key``'s pages unless it is held, in flight or in use by the running layer."""
        self.io.drop(self.io.flat(key))

    def request_fill(self) -> None:
        """Run ``fill_spare`` at the next batch end (on the thread that decodes: the core is
        only ever changed there while a decode can run)."""
        self._want_fill = True

    # ---- RouteObserver (the reference hook; live, the C hook steps the C tier) ---------
    def on_route(self, event) -> None:
        """Page in the layer's experts before its matmul; a failed read raises
        ``TierReadError`` (the decode fails with RouteCaptureError)."""
        self.io.step(event.layer, np.asarray(event.experts), int(event.phase))

    def on_batch_end(self, phase: Phase, n_tokens: int) -> None:
        """The batch's last matmul has run: release the lease, drop transients, drain.
        TierReadError when a read the matmul waited for failed."""
        try:
            self.io.batch_end()
        finally:
            self.after_batch()

    def after_batch(self) -> None:
        """Once per decode call: the C side's events (mlock follows them), the
        background reads that failed, the refill trigger, a requested ``fill_spare``."""
        events, _ = self.io.take_events()
        ne = self.io.n_expert
        for kind, flat in events:
            key = ExpertKey(flat // ne, flat % ne)
            if kind == EV_ADMIT and self.io.held[flat]:
                self._lock_if_allowed(key)
            elif kind == EV_DROP:
                self._unlock(key)
        with self._guard:
            failed, self._failed = self._failed, []
        for ticket in failed:
            self.manager.transfer_failed(ticket)
        if self._regions_stale:
            self._regions_stale = False
            self.io.set_regions(self.pager.mapping)
        if self._want_fill:
            self._want_fill = False
            self.fill_spare()

    def _reclaimed_at(self, layer: int) -> None:
        """From C (a rare event): held experts of ``layer`` were found reclaimed, before the
        layer's reads; the refiller checks whether the whole cache went cold."""
        try:
            self.refiller.maybe_start(layer, self.n_layer)
        except Exception as exc:  # noqa: BLE001 - never into C; demand reads still work
            self._warn_once(f"ram tier: refill check: {type(exc).__name__}: {exc}")

    def _warn_once(self, message: str) -> None:
        with self._guard:
            self._errors += 1
            if message in self._warned:
                return
            self._warned.add(message)
        self.notices.append(message)
        log.warning("%s", message)

    # ---- internals ----------------------------------------------------------------------
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
            self._regions_stale = True     # C learns at batch end (it may be reading them now)
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

    def _unlock(self, key: ExpertKey) -> None:
        if self.pager.locked_bytes:
            for offset, length in self.layout.ranges(key):
                self.pager.unlock(offset, length)

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
    def read_wait_s(self) -> float:
        """Seconds a thread has waited for the tier's reads so far (the step or the matmul)."""
        return self.io.counters().wait_s

    def stats(self) -> TierStats:
        c = self.io.counters()
        with self._guard:
            return TierStats(c.routes, c.paged_bytes + self._paged, c.reclaimed_bytes,
                             c.wait_s, c.prefetched_bytes + self._prefetched,
                             c.dropped + self._dropped,
                             self.pager.locked_bytes, self._errors,
                             self.refiller.refilled_bytes if self.refiller else 0,
                             c.one_use_peak_bytes, c.drop_wait_s)

    def truth(self) -> ResidencyTruth:
        """Manager view vs ``mincore`` (one mincore pass over the mapping: ~1 ms per GiB)."""
        resident = self.layout.resident_bytes(self.pager.mapping.resident_pages())
        manager_view = self.manager.snapshot().device(DEVICE).resident_bytes
        return ResidencyTruth(int(manager_view), int(resident.sum()), self.budget_bytes)

    def to_prometheus(self) -> str:
        """Prometheus text: resident bytes by view (manager / mincore), budget, counters."""
        return prometheus_text(self.truth(), self.stats())

    def release(self) -> int:
        """Drop every expert's pages from the mapping and the page cache (the model goes to
        sleep; call it before ``close``: the pager drops through llama.cpp's mapping).
        Returns the bytes ``mincore`` saw resident before."""
        resident = int(self.truth().mincore_resident_bytes)
        page = vm.PAGE_SIZE
        self.pager.drop([(o // page * page, -(-(o + n) // page) * page - o // page * page)
                         for o, n in self.layout.merged_spans()])
        return resident

    def drop_unheld(self) -> None:
        """Drop the pages of every expert not held (at attach: llama.cpp populated them all)."""
        for key in self.layout.keys:
            self.io.drop(self.io.flat(key))

    def fill_spare(self) -> int:
        """When the budget has room for every expert not yet resident, prefetch them all
        (layer order) through the manager; nothing to choose, so no policy is overridden.
        Returns how many tickets were issued."""
        device = self.manager.snapshot().device(DEVICE)
        if device.capacity_bytes is None:
            return 0
        free = device.capacity_bytes - device.resident_bytes
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
        n = 0
        for key in self.layout.keys:
            if resident[self.layout.key_index(key)] and self.io.drop(self.io.flat(key)):
                n += 1
        return n

    def close(self) -> None:
        with self._guard:
            waits = [f for _, f in self._inflight.values()]
        for fut in waits:
            fut.result()
        if self.refiller is not None:
            self.refiller.close()
        self.lane.close()
        self.io.close()
        self.pager.close()
