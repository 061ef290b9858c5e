"""Stateful property test: random accesses, prefetches, leases, reconfigures.

Two managers run the same operations in lockstep (same decisions expected); after every step
the bookkeeping invariants hold (capacity, membership vs bytes) and no leased expert
was ever chosen as a victim.
"""
from __future__ import annotations

import numpy as np
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (RuleBasedStateMachine, initialize, invariant, precondition,
                                 rule)

from runtime.errors import UserError
from runtime.residency.config import PhasePolicies, PolicySpec, ResidencyConfig
from runtime.residency.manager import ExpertResidencyManager
from runtime.residency.types import ExpertKey, Phase

LAYERS, EXPERTS = 3, 6
BYTES = [100, 0, 150]                       # layer 1 is dense
MOE = [0, 2]
EVICTIONS = ["lru", "lfu", "lfu-decay", "phase-weighted"]
ADMISSIONS = ["always", "reuse-threshold", "transient-on-pressure"]
PREFETCHES = ["none", "chunk-plan", "popularity"]


def make_config(data) -> ResidencyConfig:
    def phase(i):
        return PhasePolicies(admission=PolicySpec(ADMISSIONS[data[i] % 3]),
                             prefetch=PolicySpec(PREFETCHES[data[i + 1] % 3]),
                             eviction=PolicySpec(EVICTIONS[data[i + 2] % 4]))
    from runtime.residency.policies.factory import make_spec
    def filled(pp):
        return PhasePolicies(*(make_spec(r, getattr(pp, r).name) for r in
                               ("admission", "prefetch", "eviction")))
    prefill, decode = filled(phase(0)), filled(phase(3))
    if decode.eviction.name == "lfu-decay" or prefill.eviction.name == "lfu-decay":
        pass  # same default half_life in both phases
    return ResidencyConfig(phase_specific=bool(data[6] % 2), prefill=prefill, decode=decode)


class ResidencyMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.managers = None

    @initialize(data=st.lists(st.integers(0, 11), min_size=7, max_size=7),
                capacity=st.integers(100, 900))
    def setup(self, data, capacity):
        cfg = make_config(data)
        self.managers = []
        for _ in range(2):
            m = ExpertResidencyManager(cfg)
            m.bind_model(BYTES, EXPERTS)
            m.reconfigure("dev", capacity)
            self.managers.append(m)
        self.accesses: list[tuple] = []      # active LayerAccess pairs

    def leased_keys(self) -> set[ExpertKey]:
        return {ExpertKey(a.layer, int(e)) for a, _, ids in self.accesses for e in ids}

    def check_victims(self, victims, protected):
        assert not (set(victims) & protected), f"leased expert evicted: {set(victims) & protected}"

    @precondition(lambda self: self.managers is not None)
    @rule(layer=st.sampled_from(MOE), ids=st.lists(st.integers(0, EXPERTS - 1), min_size=1,
                                                   max_size=8),
          phase=st.sampled_from(list(Phase)), hold=st.booleans())
    def access(self, layer, ids, phase, hold):
        experts = np.array(ids, dtype=np.int64)
        protected = self.leased_keys() | {ExpertKey(layer, e) for e in ids}
        results = [m.access_layer("dev", layer, experts, phase) for m in self.managers]
        a, b = results
        assert a[:-1] == b[:-1]
        self.check_victims(a.evicted, protected)
        assert a.hits + a.misses <= len(ids)
        assert len(a.admitted) + len(a.transient) <= a.misses
        if hold:
            self.accesses.append((a, b, ids))
        else:
            for m, r in zip(self.managers, results):
                m.release(r)

    @precondition(lambda self: self.managers is not None and self.accesses)
    @rule(i=st.integers(0, 100), twice=st.booleans())
    def release(self, i, twice):
        a, b, _ = self.accesses.pop(i % len(self.accesses))
        for m, r in zip(self.managers, (a, b)):
            m.release(r)
            if twice:
                m.release(r)

    @precondition(lambda self: self.managers is not None)
    @rule(keys=st.lists(st.tuples(st.sampled_from(MOE), st.integers(0, EXPERTS - 1)),
                        max_size=4), phase=st.sampled_from(list(Phase)))
    def prefetch(self, keys, phase):
        protected = self.leased_keys()
        ks = [ExpertKey(*k) for k in keys]
        out = [m.prefetch("dev", ks, phase) for m in self.managers]
        assert out[0] == out[1]
        for t in out[0]:
            self.check_victims(t.victims, protected)

    @precondition(lambda self: self.managers is not None)
    @rule(capacity=st.integers(50, 1200))
    def reconfigure(self, capacity):
        outcomes = []
        for m in self.managers:
            snap = m.snapshot().device("dev")
            before = m.capacity("dev")
            try:
                m.reconfigure("dev", capacity)
                outcomes.append("ok")
                assert capacity >= snap.resident_bytes
            except UserError:
                outcomes.append("refused")
                assert m.capacity("dev") == before
                assert capacity < snap.resident_bytes
        assert outcomes[0] == outcomes[1]

    @invariant()
    def bookkeeping(self):
        if self.managers is None:
            return
        for m in self.managers:
            m.verify()
            d = m.snapshot().device("dev")
            assert d.resident_bytes <= d.capacity_bytes
        a, b = (m.snapshot() for m in self.managers)
        assert a == b
        masks = [[m.resident_mask("dev", layer).tolist() for layer in MOE]
                 for m in self.managers]
        assert masks[0] == masks[1]


ResidencyMachine.TestCase.settings = settings(
    max_examples=200, stateful_step_count=50, deadline=None,
    suppress_health_check=[HealthCheck.too_slow])
TestResidencyProperties = ResidencyMachine.TestCase
