"""The background read lane: the manager's transfers (tickets) read here, one at a time.

One thread takes jobs (byte ranges) in submission order and reads each with the pager's
explicit preads (its chunks in parallel), so at most one job's chunks compete with the
layers' demand reads (the C reader's) in the disk's queue, while a long run of transfers still
streams at the disk's rate. Each job's future resolves with a ``PageInStats`` once all its
pages are in the page cache.
"""
from __future__ import annotations

import queue
import threading
from concurrent.futures import Future

from runtime.ramtier.pager import PageInStats, Pager



class BackgroundLane:
    """``submit(spans) -> Future[PageInStats]``; ``close()`` finishes queued jobs first."""

    def __init__(self, pager: Pager):
        self.pager = pager
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="ramtier-lane", daemon=True)
        self._thread.start()

    def submit(self, spans: list[tuple[int, int]]) -> Future:
        done: Future = Future()
        self._jobs.put((list(spans), done))
        return done

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:                     # close(): the jobs before it are done
                return
            spans, done = job
            done.set_result(self.pager.page_in(spans))

    def close(self) -> None:
        self._jobs.put(None)
        self._thread.join()
