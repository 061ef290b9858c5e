"""The background read lane: prefetch reads stream here, behind the demand reads.

One thread takes jobs (byte ranges) in submission order, queues each with ``MADV_WILLNEED``
and keeps at most ``WINDOW_BYTES`` in flight: a demand read (the pager's thread pool, issued
from the routing hook) never waits behind more than that in the disk's queue, while a long
prefetch still streams at the disk's sequential rate. Each job's future resolves with a
``PageInStats`` once all its pages are in the page cache.
"""
from __future__ import annotations

import queue
import threading
import time
from concurrent.futures import Future

from runtime.ramtier.pager import PageInStats, Pager

WINDOW_BYTES = 16 << 20   # background reads in flight at most


class BackgroundLane:
    """``submit(spans) -> Future[PageInStats]``; ``close()`` finishes queued jobs first."""

    def __init__(self, pager: Pager):
        self.pager = pager
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="ramtier-lane", daemon=True)
        self._thread.start()

    def submit(self, spans: list[tuple[int, int]]) -> Future:
        done: Future = Future()
        self._jobs.put((list(spans), done, time.perf_counter()))
        return done

    def _run(self) -> None:
        window: list[tuple[list[tuple[int, int]], Future, float]] = []
        in_flight = 0
        while True:
            if window and self._jobs.empty():
                job = None                      # nothing new: finish the oldest read
            else:
                job = self._jobs.get()
                if job is None:                 # close(): drain and stop
                    for item in window:
                        self._finish(item)
                    return
            if job is not None:
                spans = job[0]
                self.pager.advise(spans)        # unmapped bytes: wait_for reads them whole
                window.append(job)
                in_flight += sum(n for _, n in spans)
                if in_flight <= WINDOW_BYTES:
                    continue
            oldest = window.pop(0)
            in_flight -= sum(n for _, n in oldest[0])
            self._finish(oldest)

    def _finish(self, item) -> None:
        spans, done, t0 = item
        error = None
        try:
            self.pager.wait_for(spans)
        except OSError as err:
            error = str(err)
        done.set_result(PageInStats(sum(n for _, n in spans), time.perf_counter() - t0, error))

    def close(self) -> None:
        self._jobs.put(None)
        self._thread.join()
