"""The server's resident memory over a soak (scripts/soak.py): sampled every few seconds, its
level after a warm-up against its level at the end, and its slope in between.

A server's RSS climbs at first and then levels off: the allocator's heaps grow to the most
that the traffic ever held at once (a burst of big-enum schemas while slots are saved, say)
and keep those pages for the next time. That plateau is reached once the rare coincidences
of the mix have happened, after a minute or two; a leak keeps climbing after it. So the
check compares the level at the end with the level after ``warmup_s`` (``TOLERANCE``: ±5%),
each the median of a window of samples (``WINDOW_S``: one sample moves by the requests in
flight, ±3%), and reports the slope of the samples in between (a least-squares line, MiB per
minute), which tells a late step from a steady climb, and the median of each minute.

    watch = RssWatch(pid).start()
    ...
    report = watch.stop(warmup_s=120)      # {"after_warmup", "end", "growth", ...}
"""
from __future__ import annotations

import threading
import time

import psutil

TOLERANCE = 0.05         # |end / after warm-up - 1| at most this
EVERY_S = 5.0            # s between samples
WINDOW_S = 60.0          # s of samples whose median is a level (less in a run under 5 windows)


def warmup_s(minutes: float) -> float:
    """The warm-up of a soak of ``minutes``: a fifth of it, at most 2 minutes (the plateau
    of the standard mix: docs/benchmarks/2026-12-07-soak-memory.md)."""
    return min(120.0, minutes * 60 / 5)


def slope(samples: list[tuple[float, int]]) -> float | None:
    """Least-squares slope of (s, bytes) samples, in MiB per minute (None under 3 samples)."""
    if len(samples) < 3:
        return None
    n = len(samples)
    mt = sum(t for t, _ in samples) / n
    mr = sum(r for _, r in samples) / n
    var = sum((t - mt) ** 2 for t, _ in samples)
    if var == 0:
        return None
    cov = sum((t - mt) * (r - mr) for t, r in samples)
    return cov / var * 60 / 2**20


class RssWatch:
    """Samples process ``pid``'s RSS every ``every_s`` seconds on a thread until ``stop``."""

    def __init__(self, pid: int, every_s: float = EVERY_S) -> None:
        self._process = psutil.Process(pid)
        self._every_s = every_s
        self._stop = threading.Event()
        self._t0 = time.monotonic()
        self.samples: list[tuple[float, int]] = []        # (s since start, bytes)
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> RssWatch:
        self._thread.start()
        return self

    def _sample(self) -> None:
        try:
            self.samples.append((time.monotonic() - self._t0, self._process.memory_info().rss))
        except psutil.Error:                      # the server has gone: soak.py reports it
            self._stop.set()

    def _run(self) -> None:
        while not self._stop.is_set():
            self._sample()
            self._stop.wait(self._every_s)

    def stop(self, warmup_s: float) -> dict:
        """Stop (after one last sample: the end, the server idle) and report, in MiB: the
        level after ``warmup_s`` and at the end (medians of a window each), the last sample,
        the peak, the growth between the levels (a fraction), the slope after the warm-up,
        the median of each minute, and ``ok``: the growth within ``TOLERANCE``."""
        self._stop.set()
        self._thread.join()
        self._sample()
        after = [(t, r) for t, r in self.samples if t >= warmup_s]
        if len(after) < 2:
            raise ValueError(f"no RSS samples past the {warmup_s:g} s warm-up: a longer soak")
        window = min(WINDOW_S, (after[-1][0] - after[0][0]) / 5)
        start = _median([r for t, r in after if t <= after[0][0] + window])
        end = _median([r for t, r in after if t >= after[-1][0] - window])
        growth = end / start - 1
        rate = slope(after)
        minutes: dict[int, list[int]] = {}
        for t, r in self.samples:
            minutes.setdefault(int(t // 60), []).append(r)
        return {"warmup_s": round(warmup_s, 1), "window_s": round(window, 1),
                "after_warmup": round(start / 2**20, 1), "end": round(end / 2**20, 1),
                "last": round(after[-1][1] / 2**20, 1),
                "peak": round(max(r for _, r in self.samples) / 2**20, 1),
                "growth": round(growth, 4),
                "slope_mib_per_min": None if rate is None else round(rate, 3),
                "by_minute": [round(_median(v) / 2**20, 1) for _, v in sorted(minutes.items())],
                "samples": len(self.samples), "ok": abs(growth) <= TOLERANCE}


def _median(values: list[int]) -> float:
    values = sorted(values)
    mid = len(values) // 2
    return values[mid] if len(values) % 2 else (values[mid - 1] + values[mid]) / 2
