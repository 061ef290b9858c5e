"""Threaded stress: 8 threads over a transport whose copies sleep outside the manager's lock
and sometimes fail (transfer_failed); no deadlock, invariants hold, and copies overlap."""
from __future__ import annotations

import threading
import time

import numpy as np

from runtime.residency.config import PhasePolicies, PolicySpec, ResidencyConfig
from runtime.residency.manager import ExpertResidencyManager
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
                raise OSError("simulated copy failure")  # -> transfer_failed
        finally:
            with gauge:
                in_flight -= 1

    dropped = []

    class SleepyTransport:
        """Copies in the calling thread after the manager released its lock, as the RAM
        tier's reads run; a failed copy tells the manager."""

        def bind(self, manager) -> None:
            self.manager = manager

        def submit(self, ticket) -> None:
            try:
                copy(ticket)
            except OSError:
                self.manager.transfer_failed(ticket)

        def drop(self, device, key) -> None:
            dropped.append(key)

    transport = SleepyTransport()
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
    m.verify()
    snap = m.snapshot().device("cuda:0")
    assert snap.resident_bytes <= 40 * 1000
    assert min(counts) > 0
    assert max_in_flight >= 2, max_in_flight       # copies ran outside the lock, together
    assert failures > 0
    assert snap.total.admissions > 0 and snap.total.evictions > 0 and dropped
