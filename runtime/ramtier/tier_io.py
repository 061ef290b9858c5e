"""The RAM tier's per-layer work in C (tier_io.c, see tier_io.h): one handle per tier.

``TierIO`` owns the C object and the arrays it shares with Python: ``held`` and ``busy`` (one
byte per flat key = layer * n_expert + expert; the protocol is in tier_io.h) and the layout's
tables. The routing hook steps it per MoE layer-step in native mode (``native_handle``);
``step`` does the same from Python (the reference hook, tests). The Python references of its rules are
``ExpertLayout.droppable`` and ``Pager.page_in``.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from runtime.clib import load_library
from runtime.ramtier.layout import ExpertLayout
from runtime.ramtier import vm
from runtime.ramtier.mapping import FileMapping

EV_ADMIT, EV_DROP = 1, 2


class TierReadError(RuntimeError):
    """A read the tier needed failed (EIO, a short read: the file was truncated); the decode
    that needed it fails with the routing hook's RouteCaptureError."""


@dataclass(frozen=True, slots=True)
class StepCounters:
    routes: int
    paged_bytes: int         # queued by the layer-steps (demand)
    reclaimed_bytes: int
    wait_s: float            # wall time a thread waited for reads (the step or the matmul)
    dropped: int
    prefetched_bytes: int
    read_bytes: int = 0      # bytes read from the file
    ready_bytes: int = 0     # bytes of ranges already read when first needed
    late_bytes: int = 0      # bytes of ranges still coming when first needed
    step_s: float = 0.0      # time in the layer-steps themselves
    drop_wait_s: float = 0.0     # part of it spent on queued drops (the one-use room)
    one_use_peak_bytes: int = 0  # most one-use + queued-drop bytes at a read (<= the room)


class TierIO:
    """The C side of one tier over ``core`` (the cpu device's residency core, inline)."""

    def __init__(self, core, layout: ExpertLayout, mapping: FileMapping, *, n_layer: int,
                 n_expert: int, fd: int, threads: int):
        self.lib, self.ffi = load_library()
        self.n_expert = n_expert
        self.n_flat = n_layer * n_expert
        self.held = np.zeros(self.n_flat, dtype=np.uint8)
        self.busy = np.zeros(self.n_flat, dtype=np.uint8)
        self._tables = layout.native_tables(self.flat, self.n_flat)
        t, ffi = self._tables, self.ffi
        handle = self.lib.rt_create(
            core, n_layer, n_expert, self._ptr("int64_t[]", t["range_start"]),
            self._ptr("int64_t[]", t["range_off"]), self._ptr("int64_t[]", t["range_len"]),
            self._ptr("int64_t[]", t["edge_start"]), self._ptr("int32_t[]", t["edge_owner"]),
            self._ptr("uint8_t[]", t["edge_full"]), self._ptr("uint8_t[]", self.held),
            self._ptr("uint8_t[]", self.busy), fd, threads)
        if handle == ffi.NULL:
            raise MemoryError("rt_create failed")
        self._handle = handle
        self.set_regions(mapping)
        limit = vm.max_request_bytes(mapping.path)
        if limit is not None:     # readahead(2) reads at most one device request per call
            self.lib.rt_set_read_chunk(handle, limit)

    def _ptr(self, kind: str, array: np.ndarray):
        if not len(array):
            return self.ffi.NULL
        return self.ffi.from_buffer(kind, array, require_writable=kind == "uint8_t[]")

    @property
    def native_handle(self):
        """The ``rt_tier *`` the routing hook steps (route_hook.h: rh_add_consumer)."""
        return self._handle

    def flat(self, key) -> int:
        return key.layer * self.n_expert + key.expert

    def set_regions(self, mapping: FileMapping) -> None:
        """Tell C where the file is mapped (call again after ``mapping.refresh()``)."""
        rows = [(r.offset, r.end - r.start, r.start, i)
                for i, regions in enumerate(mapping.copies) for r in regions]
        cols = [np.array([row[c] for row in rows], dtype=np.int64) for c in range(3)]
        copy = np.array([row[3] for row in rows], dtype=np.int32)
        ffi = self.ffi
        if self.lib.rt_set_regions(self._handle, len(rows), *(ffi.from_buffer("int64_t[]", c)
                                                             for c in cols),
                                   ffi.from_buffer("int32_t[]", copy)) != 0:
            raise MemoryError("rt_set_regions failed")

    def set_fd(self, fd: int) -> None:
        self.lib.rt_set_fd(self._handle, fd)

    def on_reclaim(self, fn) -> None:
        """``fn(layer)`` at the first layer of a batch whose hits the kernel reclaimed (a rare
        event: a Python call from the hook, before that layer's reads). Must not raise."""
        self._on_reclaim = self.ffi.callback("rt_reclaim_cb", lambda layer, _user: fn(layer))
        self.lib.rt_set_on_reclaim(self._handle, self._on_reclaim, self.ffi.NULL)

    def set_mlock(self, on: bool) -> None:
        self.lib.rt_set_mlock(self._handle, int(on))

    def set_one_use_room(self, nbytes: int | None) -> None:
        """Bound the pages the core does not count (a layer-step's transient uses and the
        queued drops) by ``nbytes``; None: no bound (tier_io.h: rt_set_one_use_room)."""
        self.lib.rt_set_one_use_room(self._handle, -1 if nbytes is None else int(nbytes))

    # ---- per layer-step -----------------------------------------------------------------
    def step(self, layer: int, experts: np.ndarray, phase: int) -> None:
        """One layer-step from Python (the reference hook, tests): decide, drop, read, wait."""
        experts = np.ascontiguousarray(experts, dtype=np.int32).reshape(-1)
        rc = self.lib.rt_step(self._handle, layer, self.ffi.from_buffer("int32_t[]", experts),
                              len(experts), phase)
        if rc != 0:
            raise TierReadError(self.error())

    def batch_end(self) -> None:
        """End the batch; TierReadError when a read the matmul waited for failed."""
        if self.lib.rt_batch_end(self._handle) != 0:
            raise TierReadError(self.error())

    def set_async(self, on: bool) -> bool:
        """The matmul waits per expert matrix (the caller installed ggml's weight-ready hook,
        ``weight_ready_pointer``); False when this process has too many tiers for it."""
        return self.lib.rt_set_async(self._handle, int(on)) == 0 or not on

    def weight_ready_pointer(self) -> int:
        """The address of ``rt_weight_ready``, for ``ggml_cpu_set_weight_ready``."""
        return int(self.ffi.cast("uintptr_t", self.ffi.addressof(self.lib, "rt_weight_ready")))

    def error(self) -> str:
        return self.ffi.string(self.lib.rt_error(self._handle)).decode()

    # ---- pages --------------------------------------------------------------------------
    def droppable(self, flat: int) -> list[tuple[int, int]]:
        off = np.zeros(16, dtype=np.int64)
        length = np.zeros(16, dtype=np.int64)
        n = self.lib.rt_droppable(self._handle, flat, self.ffi.from_buffer("int64_t[]", off),
                                  self.ffi.from_buffer("int64_t[]", length), 16)
        return list(zip(off[:n].tolist(), length[:n].tolist()))

    def pending_drop_bytes(self) -> int:
        """Bytes of the evicted / transient keys whose drop (on the tier's drop thread) is
        queued or running: an upper bound of what they still hold."""
        return int(self.lib.rt_pending_drop_bytes(self._handle))

    def drain_drops(self) -> None:
        """Return once every queued drop has run."""
        self.lib.rt_drain_drops(self._handle)

    def drop(self, flat: int) -> int:
        """Drop ``flat``'s pages unless it is held, busy or running; bytes dropped."""
        return int(self.lib.rt_drop(self._handle, flat))

    def page_in(self, spans: list[tuple[int, int]]) -> None:
        """Read file ranges into the page cache on this thread (explicit preads);
        TierReadError."""
        off = np.array([o for o, _ in spans], dtype=np.int64)
        length = np.array([n for _, n in spans], dtype=np.int64)
        if spans and self.lib.rt_page_in(self._handle, self.ffi.from_buffer("int64_t[]", off),
                                         self.ffi.from_buffer("int64_t[]", length),
                                         len(spans)) != 0:
            raise TierReadError(self.error())

    # ---- the batch-end drain ------------------------------------------------------------
    def take_events(self) -> tuple[list[tuple[int, int]], int]:
        """([(kind, flat), ...] since the last call, first layer with reclaimed hits or -1)."""
        h, lib = self._handle, self.lib
        n = lib.rt_n_events(h)
        layer = lib.rt_reclaimed_layer(h)
        if n == 0:
            lib.rt_clear_events(h)
            return [], layer
        kind = np.empty(n, dtype=np.int32)
        flat = np.empty(n, dtype=np.int32)
        lib.rt_events(h, self.ffi.from_buffer("int32_t[]", kind),
                      self.ffi.from_buffer("int32_t[]", flat))
        lib.rt_clear_events(h)
        return list(zip(kind.tolist(), flat.tolist())), layer

    def counters(self) -> StepCounters:
        s = self.ffi.new("rt_stats *")
        self.lib.rt_get_stats(self._handle, s)
        return StepCounters(int(s.routes), int(s.paged_bytes), int(s.reclaimed_bytes),
                            s.wait_ns / 1e9, int(s.dropped), int(s.prefetched_bytes),
                            int(s.read_bytes), int(s.ready_bytes), int(s.late_bytes),
                            s.step_ns / 1e9, s.drop_wait_ns / 1e9, int(s.one_use_peak))

    def close(self) -> None:
        """Stop the read threads and free the C object (idempotent)."""
        if self._handle is not None:
            self.lib.rt_set_on_reclaim(self._handle, self.ffi.NULL, self.ffi.NULL)
            self.lib.rt_free(self._handle)
            self._handle = None
