"""Static residency: plan_static picks the first whole layers that fit; pin_static pins them
for good; on a static device pinned experts hit and everything else is a transient miss."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from runtime.errors import UserError
from runtime.residency.config import parse_config, preset_config
from runtime.residency.manager import ExpertResidencyManager
from runtime.residency.static import StaticPlan, first_fitting_layers
from runtime.residency.types import ExpertKey, Phase
from tests.runtime.residency.conftest import live_policies

EXPERTS = 4
BYTES = [0, 100, 50, 200, 100]            # layer 0 dense; one expert's bytes per layer
LAYER_BYTES = {1: 400, 2: 200, 3: 800, 4: 400}   # a whole layer's experts


def gpu_manager(budget: str, expert_bytes=BYTES, policy: str | None = None):
    """A manager as the engine builds it: config with a cuda:0 budget, bound, resolved."""
    data = {"devices": {"cuda:0": budget}}
    if policy is not None:
        data["policy"] = {"decode": {"eviction": policy}, "prefill": {"eviction": policy}}
    m = ExpertResidencyManager(parse_config(data))
    m.bind_model(expert_bytes, EXPERTS)
    m.resolve_device("cuda:0", free_bytes=10_000, total_bytes=20_000)
    return m


@pytest.mark.parametrize("budget, layers, used", [
    ("200B", (), 0),               # layer 1 (400 B) does not fit: nothing, even though 2 would
    ("599B", (1,), 400),
    ("600B", (1, 2), 600),
    ("1399B", (1, 2), 600),        # layer 3 (800 B) stops the run; layer 4 is not skipped to
    ("1400B", (1, 2, 3), 1400),
    ("1800B", (1, 2, 3, 4), 1800),
    ("9000B", (1, 2, 3, 4), 1800),
])
def test_plan_static_picks_the_first_layers_that_fit(budget, layers, used):
    m = gpu_manager(budget)
    plan = m.plan_static("cuda:0")
    assert plan == StaticPlan("cuda:0", layers, len(layers) * EXPERTS, used)
    assert m.snapshot().device("cuda:0").resident_experts == 0   # planning changes nothing
    assert not m.is_static("cuda:0")


def test_plan_static_from_a_share_of_free_memory():
    m = ExpertResidencyManager(parse_config({"devices": {"cuda:0": "10%"}}))
    m.bind_model(BYTES, EXPERTS)
    m.resolve_device("cuda:0", free_bytes=6_500, total_bytes=20_000)   # 650 bytes
    assert m.plan_static("cuda:0").layers == (1, 2)


def test_first_fitting_layers_matches_a_brute_force_prefix():
    rng = np.random.default_rng(3)
    for _ in range(200):
        eb = [int(x) if rng.random() > 0.3 else 0 for x in rng.integers(1, 50, 8)]
        cap = int(rng.integers(1, 1200))
        layers, used = first_fitting_layers(eb, 3, cap)
        moe = [i for i, b in enumerate(eb) if b]
        best = max((n for n in range(len(moe) + 1)
                    if sum(eb[i] * 3 for i in moe[:n]) <= cap), default=0)
        assert layers == tuple(moe[:best]) and used == sum(eb[i] * 3 for i in layers)


def test_plan_static_needs_a_resolved_known_device():
    m = ExpertResidencyManager(parse_config({"devices": {"cuda:0": "1KiB"}}))
    m.bind_model(BYTES, EXPERTS)
    with pytest.raises(UserError, match="resolved capacity"):
        m.plan_static("cuda:0")
    with pytest.raises(UserError, match="unknown device"):
        m.plan_static("cuda:1")


def test_pin_static_makes_the_plan_resident_and_shows_in_telemetry():
    m = gpu_manager("700B")
    plan = m.plan_static("cuda:0")
    m.pin_static("cuda:0", plan)
    m.verify()
    assert m.is_static("cuda:0")
    for layer in (1, 2):
        assert m.resident_mask("cuda:0", layer).all()
    assert not m.resident_mask("cuda:0", 3).any()
    d = m.snapshot().device("cuda:0")
    assert (d.resident_bytes, d.resident_experts, d.static_bytes) == (600, 8, 600)
    assert d.capacity_bytes == 700
    assert m.snapshot().to_dict()["devices"]["cuda:0"]["static_bytes"] == 600
    prom = m.snapshot().to_prometheus()
    assert 'moe_expert_static_bytes{device="cuda:0"} 600' in prom
    assert 'moe_expert_resident_experts{device="cuda:0"} 8' in prom


def test_static_accesses_hit_pinned_and_use_the_rest_transiently():
    m = gpu_manager("700B")
    m.pin_static("cuda:0", m.plan_static("cuda:0"))
    a = m.access_layer("cuda:0", 1, np.array([0, 3, 3, 1]), Phase.PREFILL)
    assert (a.hits, a.misses, a.admitted, a.evicted, a.transient) == (4, 0, (), (), ())
    m.release(a)
    b = m.access_layer("cuda:0", 3, np.array([2, 0, 2]), Phase.DECODE)
    assert (b.hits, b.misses, b.demand_miss_bytes) == (1, 2, 400)
    assert b.admitted == () and b.evicted == ()
    assert b.transient == (ExpertKey(3, 2), ExpertKey(3, 0))
    m.release(b)
    for _ in range(50):                     # misses never displace the pinned experts
        m.release(m.access_layer("cuda:0", 4, [0, 1, 2, 3], Phase.DECODE))
    assert not m.resident_mask("cuda:0", 4).any() and m.resident_mask("cuda:0", 1).all()
    assert m.prefetch("cuda:0", [ExpertKey(4, 0)], Phase.DECODE) == []
    m.verify()
    d = m.snapshot().device("cuda:0")
    pre, dec = d.phase(Phase.PREFILL), d.phase(Phase.DECODE)
    assert (pre.accesses, pre.hits, pre.misses) == (4, 4, 0)
    assert (dec.accesses, dec.misses, dec.transient_uses, dec.transient_bytes) == (
        203, 202, 202, 2 * 200 + 200 * 100)
    assert dec.hits == 1 and dec.admissions == 0 and dec.evictions == 0
    assert dec.transition_hits == 0 and d.resident_bytes == 600


def test_static_device_with_nothing_fitting_admits_nothing():
    m = gpu_manager("200B")
    plan = m.plan_static("cuda:0")
    m.pin_static("cuda:0", plan)          # an empty plan still makes the device static
    a = m.access_layer("cuda:0", 2, [0, 1], Phase.DECODE, lease=False)
    assert a.misses == 2 and a.admitted == () and len(a.transient) == 2
    assert m.snapshot().device("cuda:0").resident_bytes == 0


def test_other_devices_keep_their_policies():
    m = ExpertResidencyManager(parse_config({"devices": {"cuda:0": "600B", "cpu": "600B"}}))
    m.bind_model(BYTES, EXPERTS)
    m.resolve_device("cuda:0", free_bytes=None, total_bytes=None)
    m.resolve_device("cpu", free_bytes=None, total_bytes=None)
    m.pin_static("cuda:0", m.plan_static("cuda:0"))
    a = m.access_layer("cpu", 3, [1, 2], Phase.DECODE)
    assert a.admitted == (ExpertKey(3, 1), ExpertKey(3, 2))
    assert not m.is_static("cpu")


@pytest.mark.parametrize("change, match", [
    (lambda p: StaticPlan("cuda:1", p.layers, p.keys, p.bytes), "plan is for"),
    (lambda p: StaticPlan(p.device, (0,), 4, 0), "MoE layers"),
    (lambda p: StaticPlan(p.device, (1, 1), 8, 800), "MoE layers"),
    (lambda p: StaticPlan(p.device, p.layers, p.keys, p.bytes + 1), "disagree"),
    (lambda p: StaticPlan(p.device, (1, 2, 3), 12, 1400), "exceed the capacity"),
])
def test_pin_static_refuses_bad_plans_and_changes_nothing(change, match):
    m = gpu_manager("700B")
    with pytest.raises(UserError, match=match):
        m.pin_static("cuda:0", change(m.plan_static("cuda:0")))
    assert not m.is_static("cuda:0")
    assert m.snapshot().device("cuda:0").resident_bytes == 0
    m.verify()


def test_pin_static_refuses_a_device_already_in_use():
    m = gpu_manager("700B")
    plan = m.plan_static("cuda:0")
    m.release(m.access_layer("cuda:0", 4, [0], Phase.DECODE))
    with pytest.raises(UserError, match="already holds"):
        m.pin_static("cuda:0", plan)
    fresh = gpu_manager("700B")
    fresh.pin_static("cuda:0", plan)
    with pytest.raises(UserError, match="static already"):
        fresh.pin_static("cuda:0", plan)


class StaticMachine(RuleBasedStateMachine):
    """Random accesses, leases, prefetches and reconfigures on a static device: the pinned
    experts stay resident, nothing else ever becomes resident, the counters add up."""

    @initialize(budget=st.integers(200, 2000),
                policy=st.sampled_from(live_policies("eviction")))
    def setup(self, budget, policy):
        self.m = gpu_manager(f"{budget}B", policy=policy)
        self.plan = self.m.plan_static("cuda:0")
        self.m.pin_static("cuda:0", self.plan)
        self.masks = {layer: self.m.resident_mask("cuda:0", layer).tolist()
                      for layer in LAYER_BYTES}
        self.held = []
        self.accesses = self.transient = 0

    @rule(layer=st.sampled_from(list(LAYER_BYTES)),
          ids=st.lists(st.integers(0, EXPERTS - 1), min_size=1, max_size=6),
          phase=st.sampled_from(list(Phase)), hold=st.booleans())
    def access(self, layer, ids, phase, hold):
        a = self.m.access_layer("cuda:0", layer, ids, phase, lease=hold)
        assert a.admitted == () and a.evicted == ()
        pinned = layer in self.plan.layers
        assert a.misses == (0 if pinned else len(set(ids)))
        assert len(a.transient) == a.misses
        self.accesses += len(ids)
        self.transient += a.misses
        if hold:
            self.held.append(a)

    @rule()
    def release_all(self):
        for a in self.held:
            self.m.release(a)
        self.held = []

    @rule(layer=st.sampled_from(list(LAYER_BYTES)), e=st.integers(0, EXPERTS - 1))
    def prefetch(self, layer, e):
        assert self.m.prefetch("cuda:0", [ExpertKey(layer, e)], Phase.DECODE) == []

    @rule(capacity=st.integers(50, 3000))
    def reconfigure(self, capacity):
        try:
            self.m.reconfigure("cuda:0", capacity)
            assert capacity >= self.plan.bytes
        except UserError:
            assert capacity < self.plan.bytes

    @invariant()
    def pinned_for_good(self):
        self.m.verify()
        for layer, mask in self.masks.items():
            assert self.m.resident_mask("cuda:0", layer).tolist() == mask
        total = self.m.snapshot().device("cuda:0").total
        assert total.accesses == self.accesses and total.transient_uses == self.transient
        assert total.admissions == total.evictions == total.prefetch_issued == 0


StaticMachine.TestCase.settings = settings(
    max_examples=60, stateful_step_count=30, deadline=None,
    suppress_health_check=[HealthCheck.too_slow])
TestStaticProperties = StaticMachine.TestCase


def test_preset_managers_are_not_static():
    m = ExpertResidencyManager.create_simulated(expert_bytes=BYTES, n_expert=EXPERTS,
                                                capacity_bytes=600, config=preset_config("lru"))
    assert not m.is_static("sim")
    a = m.access_layer("sim", 1, [0], Phase.DECODE)
    assert a.admitted == (ExpertKey(1, 0),)
