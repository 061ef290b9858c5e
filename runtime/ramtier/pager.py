"""Parallel page-in and eviction of exact file byte ranges, through the model's own mapping.

Page-in: explicit ``pread``s of at most ``CHUNK_BYTES`` each on a thread pool (``threads`` in
flight), so the kernel reads exactly the requested bytes in requests of that size, whatever
``read_ahead_kb`` is and with no page fault; when ``page_in`` returns every byte is in the page
cache and the first touch through llama.cpp's mapping is a minor fault. Our own descriptor is
``FADV_RANDOM`` so a pread never reads ahead into a neighbouring expert. This is the slow
reference of the C reader (reader.c), which reads the same bytes the same way, off the
critical path.

Eviction: ``MADV_DONTNEED`` on every mapped copy (a mapped page cannot leave the page cache),
then ``posix_fadvise(DONTNEED)`` on the file. Callers pass page-aligned ranges they own
(``ExpertLayout.droppable``).

No lock is held across a read: the only shared state is the thread pool, and the set of
locked spans (under a short lock that is never held during I/O).
"""
from __future__ import annotations

import os
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

from runtime.ramtier import vm
from runtime.ramtier.mapping import FileMapping

CHUNK_BYTES = 512 << 10   # pread size (reader.h: RD_CHUNK_BYTES); a range's chunks spread
                          # over the threads


@dataclass(frozen=True, slots=True)
class PageInStats:
    bytes: int            # bytes requested (sum of range lengths)
    seconds: float        # wall time until every byte was in the page cache
    error: str | None = None


class Pager:
    """Reads and drops byte ranges of one mapped file; ``threads`` reads in flight."""

    def __init__(self, mapping: FileMapping, *, threads: int = 8):
        if threads < 1:
            raise ValueError("threads must be >= 1")
        self.mapping = mapping
        self.threads = threads
        self._fd = os.open(mapping.path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        os.posix_fadvise(self._fd, 0, 0, os.POSIX_FADV_RANDOM)
        try:
            os.fsync(self._fd)      # dirty pages (a file just written) cannot be dropped
        except OSError:
            pass
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="ramtier-read")
        self._local = threading.local()
        self._locked: dict[tuple[int, int], None] = {}   # file spans now mlocked
        self._locked_guard = threading.Lock()            # never held across a syscall that reads
        self.locked_bytes = 0

    # ---- page-in ----------------------------------------------------------------------------
    def page_in(self, spans: Sequence[tuple[int, int]]) -> PageInStats:
        """Bring file bytes ``[(offset, length), ...]`` into the page cache; wait for all."""
        return self.page_in_async(spans).result()

    def page_in_async(self, spans: Sequence[tuple[int, int]]) -> Future:
        """Start bringing ``spans`` in; the future's result is a ``PageInStats``. Never raises."""
        t0 = time.perf_counter()
        total = sum(n for _, n in spans)
        done: Future = Future()
        if not spans:
            done.set_result(PageInStats(0, 0.0))
            return done
        chunks = [(offset + i, min(CHUNK_BYTES, length - i))
                  for offset, length in spans for i in range(0, length, CHUNK_BYTES)]
        remaining = [len(chunks)]
        errors: list[str] = []
        guard = threading.Lock()

        def finished(fut: Future) -> None:
            err = fut.exception()
            with guard:
                if err is not None:
                    errors.append(str(err))
                remaining[0] -= 1
                last = remaining[0] == 0
            if last:
                done.set_result(PageInStats(total, time.perf_counter() - t0,
                                            errors[0] if errors else None))

        for offset, length in chunks:
            self._pool.submit(self._read, offset, length).add_done_callback(finished)
        return done

    def _read(self, offset: int, length: int) -> None:
        buf = getattr(self._local, "buf", None)
        if buf is None:
            buf = self._local.buf = bytearray(CHUNK_BYTES)
        view = memoryview(buf)
        while length > 0:
            got = os.preadv(self._fd, [view[:length]], offset)
            if got <= 0:
                raise OSError(f"{self.mapping.path}: short read at offset {offset}")
            offset, length = offset + got, length - got

    def no_readahead(self, spans: Sequence[tuple[int, int]]) -> None:
        """``MADV_RANDOM`` on every mapped copy of ``spans``: a page fault there reads that
        page only, so the kernel's read-around (up to ``read_ahead_kb``) cannot pull
        neighbouring experts the manager did not ask for into RAM."""
        for offset, length in spans:
            for addr, n in self.mapping.address_spans(offset, length, every_copy=True):
                try:
                    vm.madvise(addr, n, vm.MADV_RANDOM)
                except OSError:
                    pass

    # ---- eviction ---------------------------------------------------------------------------
    def drop(self, spans: Sequence[tuple[int, int]]) -> None:
        """Drop page-aligned file ranges from every mapping and from the page cache."""
        for offset, length in spans:
            self._unlock_within(offset, length)
            for addr, n in self.mapping.address_spans(offset, length, every_copy=True):
                try:
                    vm.madvise(addr, n, vm.MADV_DONTNEED)
                except OSError:
                    pass        # the fadvise below still drops what is unmapped
            vm.fadvise_dontneed(self._fd, offset, length)

    # ---- mlock ------------------------------------------------------------------------------
    def lock(self, offset: int, length: int) -> None:
        """mlock file bytes (first mapped copy); raises ``OSError`` when the limit forbids it."""
        spans = self.mapping.address_spans(offset, length)
        for addr, n in spans:
            vm.mlock(addr, n)
        with self._locked_guard:
            if (offset, length) not in self._locked:
                self._locked[(offset, length)] = None
                self.locked_bytes += length

    def _unlock_within(self, offset: int, length: int) -> None:
        with self._locked_guard:
            hit = [s for s in self._locked if s[0] < offset + length and offset < s[0] + s[1]]
            for s in hit:
                del self._locked[s]
                self.locked_bytes -= s[1]
        for o, n in hit:
            for addr, m in self.mapping.address_spans(o, n):
                try:
                    vm.munlock(addr, m)
                except OSError:
                    pass

    def unlock(self, offset: int, length: int) -> None:
        """munlock what this pager locked within file bytes ``[offset, offset + length)``."""
        self._unlock_within(offset, length)

    def unlock_all(self) -> None:
        """munlock everything this pager locked."""
        self._unlock_within(0, 1 << 62)

    def close(self) -> None:
        """Unlock, stop the threads, close the descriptor (idempotent)."""
        if self._fd < 0:
            return
        self.unlock_all()
        self._pool.shutdown(wait=True)
        os.close(self._fd)
        self._fd = -1

    def fileno(self) -> int:
        return self._fd


def drop_file_cache(path: str) -> None:
    """Drop every page of ``path``: from all of this process's mappings, then the page cache."""
    mapping = FileMapping.find(path)
    pager = Pager(mapping, threads=1)
    try:
        pager.drop([(0, -(-mapping.file_bytes // vm.PAGE_SIZE) * vm.PAGE_SIZE)])
    finally:
        pager.close()
