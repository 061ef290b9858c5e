"""Where each expert's bytes lie in the model file, and which pages belong to whom.

Expert byte ranges need not be page-aligned (GGUF aligns tensor data to 32 bytes), so a page at
the edge of one expert's range may hold bytes of a neighbouring expert. Eviction drops a shared
edge page only when every byte in it belongs to experts that are not resident; page-in always
brings whole pages. ``resident_bytes`` turns a ``mincore`` page vector into bytes per expert.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

import numpy as np

from runtime.ramtier.vm import PAGE_SIZE


class ExpertLayout:
    """All routed-expert byte ranges of a model file: ``key -> ((offset, length), ...)``.

    Keys are whatever the caller uses for experts (``ExpertKey`` in the runtime); ranges are
    absolute file offsets in bytes and must not overlap.
    """

    def __init__(self, ranges: Mapping[object, Iterable[tuple[int, int]]]):
        self.keys = list(ranges)
        self._ranges = {k: tuple((int(o), int(n)) for o, n in ranges[k]) for k in self.keys}
        rows = sorted((o, n, i) for i, k in enumerate(self.keys) for o, n in self._ranges[k])
        self.starts = np.array([r[0] for r in rows], dtype=np.int64)            # (n_ranges,)
        self.ends = np.array([r[0] + r[1] for r in rows], dtype=np.int64)       # (n_ranges,)
        self.owner = np.array([r[2] for r in rows], dtype=np.int64)             # (n_ranges,)
        if len(rows) > 1 and np.any(self.starts[1:] < self.ends[:-1]):
            raise ValueError("expert byte ranges overlap")
        self._index = {k: i for i, k in enumerate(self.keys)}

    @classmethod
    def from_index(cls, index) -> ExpertLayout:
        """From a ``gguf_tools.expert_index.ExpertIndex``; keys are ``ExpertKey``."""
        from runtime.residency.types import ExpertKey

        facts = index.facts
        table = {}
        for layer in facts.moe_layers:
            for expert in range(facts.n_expert):
                table[ExpertKey(layer, expert)] = [
                    (r.offset, r.length) for r in index.ranges(layer, expert)]
        return cls(table)

    def ranges(self, key) -> tuple[tuple[int, int], ...]:
        """The file byte ranges of one expert."""
        return self._ranges[key]

    def nbytes(self, key) -> int:
        return sum(n for _, n in self._ranges[key])

    @property
    def total_bytes(self) -> int:
        return int((self.ends - self.starts).sum())

    def droppable(self, key, is_resident: Callable[[object], bool]) -> list[tuple[int, int]]:
        """Page-aligned file ranges ``(offset, length)`` safe to drop when ``key`` leaves RAM.

        Pages wholly inside ``key``'s ranges always; an edge page only if all of it is covered
        by expert ranges whose owners are not resident (``key`` itself counts as leaving).
        """
        out: list[tuple[int, int]] = []
        for offset, length in self._ranges[key]:
            first = offset // PAGE_SIZE
            last = (offset + length - 1) // PAGE_SIZE          # inclusive page numbers
            lo, hi = first, last
            if offset % PAGE_SIZE and not self._page_free(first, key, is_resident):
                lo += 1
            if (offset + length) % PAGE_SIZE and hi >= lo and \
                    not self._page_free(last, key, is_resident):
                hi -= 1
            if hi >= lo:
                out.append((lo * PAGE_SIZE, (hi - lo + 1) * PAGE_SIZE))
        return out

    def _page_free(self, page: int, leaving, is_resident) -> bool:
        covered, owners = self._page_owners(page)
        # no dense tensor bytes share the page, and no other owner stays
        return covered == PAGE_SIZE and not any(o != leaving and is_resident(o) for o in owners)

    def resident_bytes(self, pages: np.ndarray) -> np.ndarray:
        """Bytes of each expert that lie in resident pages: (len(keys),) int64.

        ``pages``: (n_file_pages,) bool, e.g. ``FileMapping.resident_pages()``.
        """
        cs = np.concatenate([[0], np.cumsum(pages, dtype=np.int64)])
        first = self.starts // PAGE_SIZE
        last = (self.ends - 1) // PAGE_SIZE
        n = (cs[last + 1] - cs[first]) * PAGE_SIZE
        n -= np.where(pages[first], self.starts - first * PAGE_SIZE, 0)
        n -= np.where(pages[last], (last + 1) * PAGE_SIZE - self.ends, 0)
        out = np.zeros(len(self.keys), dtype=np.int64)
        np.add.at(out, self.owner, n)
        return out

    def merged_spans(self) -> list[tuple[int, int]]:
        """All expert bytes as maximal contiguous ``(offset, length)`` runs (about one per
        expert tensor)."""
        out: list[list[int]] = []
        for lo, hi in zip(self.starts.tolist(), self.ends.tolist()):
            if out and lo <= out[-1][1]:
                out[-1][1] = max(out[-1][1], hi)
            else:
                out.append([lo, hi])
        return [(lo, hi - lo) for lo, hi in out]

    def gaps(self, file_bytes: int) -> list[tuple[int, int]]:
        """The bytes between expert runs (dense tensors, metadata): ``(offset, length)``."""
        out, pos = [], 0
        for offset, length in self.merged_spans():
            if offset > pos:
                out.append((pos, offset - pos))
            pos = offset + length
        if pos < file_bytes:
            out.append((pos, file_bytes - pos))
        return out

    def span_of(self, keys) -> tuple[int, int]:
        """``(offset, length)`` from the first to the last byte of ``keys``' ranges."""
        lo = min(o for k in keys for o, _ in self._ranges[k])
        hi = max(o + n for k in keys for o, n in self._ranges[k])
        return lo, hi - lo

    def key_index(self, key) -> int:
        return self._index[key]

    def native_tables(self, flat_of: Callable[[object], int], n_flat: int) -> dict[str, np.ndarray]:
        """The layout as tier_io.c reads it (see tier_io.h): every key's ranges by flat key
        (``range_start`` (n_flat + 1,), ``range_off`` / ``range_len`` (n_ranges,)), and for
        each range's first and last page (edge 2r, 2r + 1) the flat keys with bytes in that
        page (``edge_start`` (2 n_ranges + 1,), ``edge_owner``) and whether expert bytes cover
        all of it (``edge_full`` (2 n_ranges,)). The same rule as ``droppable``."""
        per_flat: list[list[tuple[int, int]]] = [[] for _ in range(n_flat)]
        for key in self.keys:
            per_flat[flat_of(key)] = list(self._ranges[key])
        counts = np.array([len(r) for r in per_flat], dtype=np.int64)
        range_start = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        rows = [r for rs in per_flat for r in rs]
        off = np.array([o for o, _ in rows], dtype=np.int64)
        length = np.array([n for _, n in rows], dtype=np.int64)
        owners: list[int] = []
        edge_start = [0]
        full = []
        for o, n in rows:
            for page in (o // PAGE_SIZE, (o + n - 1) // PAGE_SIZE):
                covered, page_owners = self._page_owners(page)
                owners.extend(flat_of(k) for k in page_owners)
                edge_start.append(len(owners))
                full.append(covered == PAGE_SIZE)
        return {"range_start": range_start, "range_off": off, "range_len": length,
                "edge_start": np.array(edge_start, dtype=np.int64),
                "edge_owner": np.array(owners, dtype=np.int32),
                "edge_full": np.array(full, dtype=np.uint8)}

    def _page_owners(self, page: int) -> tuple[int, list]:
        """(expert bytes in ``page``, the keys owning them)."""
        lo_b, hi_b = page * PAGE_SIZE, (page + 1) * PAGE_SIZE
        i = int(np.searchsorted(self.ends, lo_b, side="right"))
        j = int(np.searchsorted(self.starts, hi_b, side="left"))
        covered, out = 0, []
        for r in range(i, j):
            out.append(self.keys[int(self.owner[r])])
            covered += min(hi_b, int(self.ends[r])) - max(lo_b, int(self.starts[r]))
        return covered, out
