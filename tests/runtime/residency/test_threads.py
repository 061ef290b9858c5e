"""Threaded stress: 8 threads over a transport whose copies sleep; no deadlock, invariants
hold, and at least 4 transfers are in flight at once (queue depth >= 4)."""
from __future__ import annotations

import threading
import time

import numpy as np

from runtime.residency.config import PhasePolicies, PolicySpec, ResidencyConfig
from runtime.residency.manager import ExpertResidencyManager
from runtime.residency.transport import ThreadedTransport
from runtime.residency.types import ExpertKey, Phase


def test_eight_threads_sleepy_transport():
    in_flight = 0
    max_in_flight = 0
    gauge = threading.Lock()
    failures = 0

    def copy(ticket):
        nonlocal in_flight, max_in_flight, failures
        with gauge:
            in_flight += 1
            max_in_flight = max(max_in_flight, in_flight)
        try:
            time.sleep(0.004)                    # bytes "moving": no manager lock held
            if ticket.id % 17 == 0:
                failures += 1
                raise OSError("simulated copy failure")  # -> abort
        finally:
            with gauge:
                in_flight -= 1

    dropped = []
    transport = ThreadedTransport(copy, workers=6, drop=lambda d, k: dropped.append(k))
    cfg = ResidencyConfig(phase_specific=True,
                          prefill=PhasePolicies(prefetch=PolicySpec("chunk-plan",
                                                                    (("depth", 2.0),)),
                                                eviction=PolicySpec("lru")),
                          decode=PhasePolicies(eviction=PolicySpec("lfu")))
    m = ExpertResidencyManager(cfg, transport=transport)
    m.bind_model([1000] * 8, 32)
    m.reconfigure("cuda:0", 1000 * 40)
    stop = time.monotonic() + 2.5
    errors: list[BaseException] = []
    counts = [0] * 8

    def worker(i: int) -> None:
        rng = np.random.default_rng(i)
        try:
            while time.monotonic() < stop:
                layer = int(rng.integers(0, 8))
                phase = Phase.PREFILL if rng.random() < 0.3 else Phase.DECODE
                n = 16 if phase == Phase.PREFILL else 4
                experts = rng.zipf(1.3, size=n) % 32
                a = m.access_layer("cuda:0", layer, experts, phase)
                assert m.wait(a.tickets, timeout=10.0), "ticket never finished"
                if rng.random() < 0.2:
                    m.prefetch("cuda:0", [ExpertKey(layer, int(rng.integers(0, 32)))], phase)
                if rng.random() < 0.05:
                    m.verify()
                m.release(a)
                counts[i] += 1
        except BaseException as err:  # surfaced below
            errors.append(err)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert not any(t.is_alive() for t in threads), "deadlock: a worker never finished"
    assert not errors, errors[0]
    snap = m.snapshot().device("cuda:0")
    deadline = time.monotonic() + 10
    while m.snapshot().device("cuda:0").pending_tickets and time.monotonic() < deadline:
        time.sleep(0.01)
    transport.close()
    m.verify()
    snap = m.snapshot().device("cuda:0")
    assert snap.pending_tickets == 0 and snap.pending_bytes == 0
    assert snap.resident_bytes <= 40 * 1000
    assert min(counts) > 0
    assert max_in_flight >= 4, max_in_flight
    assert failures > 0 and len(transport.errors) == failures
    assert snap.total.admissions > 0 and snap.total.evictions > 0 and dropped
