"""ExpertResidencyManager: access semantics, leases, tickets, reconfigure, determinism."""
from __future__ import annotations

from collections import OrderedDict

import numpy as np
import pytest

from runtime.errors import UserError
from runtime.residency.config import PhasePolicies, PolicySpec, ResidencyConfig
from runtime.residency.manager import ExpertResidencyManager
from runtime.residency.types import ExpertKey, Phase
from tests.runtime.residency.conftest import live_policies

K = ExpertKey
DEPTH_1 = (("depth", 1.0),)


def sim(capacity: int, policy: str | None = "lru", *, layers: int = 4, experts: int = 8,
        nbytes: int = 100, config: ResidencyConfig | None = None) -> ExpertResidencyManager:
    if config is not None:
        policy = None
    return ExpertResidencyManager.create_simulated(
        expert_bytes=[nbytes] * layers, n_expert=experts, capacity_bytes=capacity,
        policy=policy, config=config)


def test_hits_misses_and_demand_bytes():
    m = sim(300)
    a = m.access_layer("sim", 0, np.array([1, 2]), Phase.DECODE)
    assert (a.hits, a.misses, a.demand_miss_bytes) == (0, 2, 200)
    assert a.admitted == (K(0, 1), K(0, 2)) and a.evicted == () and a.transient == ()
    m.release(a)
    b = m.access_layer("sim", 0, np.array([2, 3]), Phase.DECODE)
    assert (b.hits, b.misses) == (1, 1) and b.evicted == ()
    m.release(b)
    c = m.access_layer("sim", 0, np.array([4]), Phase.DECODE)
    assert c.evicted == (K(0, 1),)            # least recently used
    m.release(c)
    assert m.is_resident("sim", K(0, 2)) and not m.is_resident("sim", K(0, 1))
    assert m.resident_mask("sim", 0).tolist() == [False, False, True, True, True, False, False,
                                                   False]
    m.verify()


def test_batch_is_leased_and_repeats_are_hits():
    # capacity 2 experts; a prefill batch needing 3 distinct experts: the third is transient,
    # nothing of the batch is evicted for it; repeated ids count as hits of the same copy
    m = sim(200)
    a = m.access_layer("sim", 1, np.array([5, 6, 5, 7, 6, 7]), Phase.PREFILL)
    assert a.misses == 3 and a.hits == 3
    assert a.admitted == (K(1, 5), K(1, 6)) and a.transient == (K(1, 7),) and a.evicted == ()
    snap = m.snapshot().device("sim").phase(Phase.PREFILL)
    assert snap.transient_uses == 1 and snap.transient_bytes == 100 and snap.accesses == 6
    m.verify()


def test_held_lease_protects_other_layers_experts():
    m = sim(200)
    held = m.access_layer("sim", 0, np.array([0, 1]), Phase.DECODE)   # not released
    b = m.access_layer("sim", 1, np.array([3]), Phase.DECODE)
    assert b.transient == (K(1, 3),) and b.evicted == ()
    m.release(b)
    m.release(held)
    m.release(held)                                                   # idempotent
    c = m.access_layer("sim", 1, np.array([3]), Phase.DECODE)
    assert c.admitted == (K(1, 3),) and c.evicted == (K(0, 0),)
    m.verify()


@pytest.mark.parametrize("core", ["native", "reference"])
def test_step_holds_one_lease_the_core_mints(core):
    # the core's step: a step's lease protects its experts until the next step or step_end;
    # every lease id, access_layer's too, comes from the core (one numbering, from 1)
    m = ExpertResidencyManager.create_simulated(expert_bytes=[100] * 4, n_expert=8,
                                                capacity_bytes=200, policy="lru", core=core)
    a = m.step("sim", 0, 0, np.array([0, 1]), Phase.DECODE)
    assert a.lease_id == 1 and a.admitted == (K(0, 0), K(0, 1))
    b = m.step("sim", 0, 1, np.array([3]), Phase.DECODE)     # a second consumer: a still held
    assert b.lease_id == 2 and b.transient == (K(1, 3),)
    c = m.access_layer("sim", 2, np.array([4]), Phase.DECODE, release=b)
    assert c.lease_id == 3 and c.transient == (K(2, 4),)
    m.release(c)
    d = m.step("sim", a.lease_id, 1, np.array([3]), Phase.DECODE)   # ends a's lease
    assert d.lease_id == 4 and d.admitted == (K(1, 3),) and d.evicted == (K(0, 0),)
    with pytest.raises(UserError, match="expert id 9"):        # refused: d ended all the same
        m.step("sim", d.lease_id, 1, np.array([9]), Phase.DECODE)
    e = m.step("sim", 0, 0, np.array([5, 6]), Phase.DECODE)
    assert e.evicted == (K(0, 1), K(1, 3))
    m.step_end("sim", e.lease_id)
    m.step_end("sim", 0)                                         # nothing held: nothing to do
    assert m.snapshot().device("sim").resident_experts == 2
    m.verify()


def lru_reference(stream, capacity, sizes):
    """Independent lru with layer-step leases, in bytes: a step's misses (routing order) evict
    the least recent keys outside the step until they fit, or evict nothing and are used once."""
    cache: OrderedDict = OrderedDict()
    used = 0
    decisions = []
    for layer, experts in stream:
        keys = [(layer, int(e)) for e in experts]
        step = set(keys)
        missing = [k for k in dict.fromkeys(keys) if k not in cache]
        for k in keys:
            if k in cache:
                cache.move_to_end(k)
        evicted, transient = [], []
        for k in missing:
            size = sizes[k[0]]
            candidates = [v for v in cache if v not in step]
            victims, freed = [], 0
            for v in candidates:
                if used - freed + size <= capacity:
                    break
                victims.append(v)
                freed += sizes[v[0]]
            if used - freed + size > capacity:
                transient.append(k)
                continue
            for v in victims:
                del cache[v]
            used += size - freed
            evicted.extend(victims)
            cache[k] = True
        for k in keys:                         # access order = last occurrence order
            if k in cache:
                cache.move_to_end(k)
        decisions.append((len(keys) - len(missing), len(missing), evicted, transient))
    return decisions


@pytest.mark.parametrize("core", ["native", "reference"])
@pytest.mark.parametrize("capacity", [150, 300, 1200, 4000])
def test_lru_matches_reference_loop(zipf_stream, core, capacity):
    sizes = [100, 170, 100, 240]               # mixed expert sizes per layer
    rng = np.random.default_rng(1)
    steps = []
    s = zipf_stream(60, 4, 16, 3, seed=2)
    for t in range(60):
        for layer in range(4):
            if t % 20 == 0:                    # a prefill-like batch with repeats
                steps.append((layer, rng.integers(0, 16, size=12)))
            else:
                steps.append((layer, s[t, layer]))
    m = ExpertResidencyManager.create_simulated(expert_bytes=sizes, n_expert=16,
                                                capacity_bytes=capacity, policy="lru",
                                                core=core)
    got = []
    for layer, experts in steps:
        a = m.access_layer("sim", layer, experts, Phase.DECODE, lease=False)
        got.append((a.hits, a.misses, [(k.layer, k.expert) for k in a.evicted],
                    [(k.layer, k.expert) for k in a.transient]))
        m.verify()
    want = lru_reference(steps, capacity, sizes)
    assert got == want
    if capacity == 150:
        assert any(d[3] for d in want)         # too small for layer 3: transient, no eviction


@pytest.mark.parametrize("policy", live_policies("eviction"))
def test_same_sequence_same_decisions(zipf_stream, policy):
    s = zipf_stream(80, 3, 12, 2, seed=5)

    def run():
        m = sim(900, policy, layers=3, experts=12)
        out = []
        for t in range(80):
            for layer in range(3):
                phase = Phase.PREFILL if t < 10 else Phase.DECODE
                a = m.access_layer("sim", layer, s[t, layer], phase)
                out.append(a[:-1])            # everything but the lease id
                m.release(a)
        return out, m.snapshot()
    assert run() == run()


def test_native_core_equals_reference_core(zipf_stream):
    s = zipf_stream(200, 6, 32, 4, seed=3)

    def run(core):
        m = ExpertResidencyManager.create_simulated(
            expert_bytes=[100] * 6, n_expert=32, capacity_bytes=40 * 100, policy="lru",
            core=core)
        out = [m.access_layer("sim", layer, s[t, layer], Phase.DECODE, lease=False)
               for t in range(200) for layer in range(6)]
        m.verify()
        return out, m.snapshot()
    assert run("native") == run("reference")


def test_phase_agnostic_equals_phase_specific_with_same_policy(zipf_stream):
    s = zipf_stream(120, 4, 16, 2, seed=7)
    for name, params in [("lru", ()), ("lfu-decay", (("half_life", 64.0),)),
                         ("phase-weighted", (("w_decode", 4.0), ("w_prefill", 1.0)))]:
        phase = PhasePolicies(admission=PolicySpec("reuse-threshold", (("break_even", 2.0),)),
                              prefetch=PolicySpec("popularity", (("top_n", 2.0),)),
                              eviction=PolicySpec(name, params))
        agnostic = ResidencyConfig(phase_specific=False, prefill=PhasePolicies(), decode=phase)
        specific = ResidencyConfig(phase_specific=True, prefill=phase, decode=phase)

        def run(cfg):
            m = sim(1000, config=cfg, layers=4, experts=16)
            out = []
            for t in range(120):
                for layer in range(4):
                    ph = Phase.PREFILL if t % 30 < 8 else Phase.DECODE
                    a = m.access_layer("sim", layer, s[t, layer], ph)
                    out.append(a[:-1])
                    m.release(a)
            m.verify()
            return out, m.snapshot()
        assert run(agnostic) == run(specific), name


class RecordingTransport:
    """Records what the manager tells a transport (drops, then transfer notices)."""

    def __init__(self) -> None:
        self.events: list = []

    def bind(self, manager) -> None:
        self.manager = manager

    def submit(self, ticket) -> None:
        self.events.append(("submit", ticket))

    def drop(self, device, key) -> None:
        self.events.append(("drop", key))


def test_a_decision_is_resident_at_once_and_a_failed_copy_forgets():
    t = RecordingTransport()
    m = ExpertResidencyManager(ResidencyConfig(), transport=t)
    m.bind_model([100] * 2, 4)
    m.reconfigure("cuda:0", 200)
    a = m.access_layer("cuda:0", 0, np.array([0, 1]), Phase.DECODE)
    assert a.admitted == (K(0, 0), K(0, 1))
    assert m.is_resident("cuda:0", K(0, 0)) and m.is_resident("cuda:0", K(0, 1))
    assert [(e, tk.key) for e, tk in t.events] == [("submit", K(0, 0)), ("submit", K(0, 1))]
    m.release(a)
    t.events.clear()
    b = m.access_layer("cuda:0", 0, np.array([2]), Phase.DECODE)
    assert b.evicted == (K(0, 0),) and not m.is_resident("cuda:0", K(0, 0))
    assert t.events[0] == ("drop", K(0, 0)) and t.events[1][1].key == K(0, 2)   # drops first
    notice = t.events[1][1]
    assert m.transfer_failed(notice) and not m.transfer_failed(notice)   # it left; once
    assert not m.is_resident("cuda:0", K(0, 2))
    assert m.snapshot().device("cuda:0").resident_experts == 1
    m.release(b)
    m.verify()


def test_reconfigure_refusals_and_atomicity():
    m = ExpertResidencyManager(ResidencyConfig(), transport=RecordingTransport())
    with pytest.raises(UserError, match="bind_model"):
        m.reconfigure("cpu", 100)
    m.bind_model([100] * 2, 4)
    m.reconfigure("cpu", 300)
    a = m.access_layer("cpu", 0, np.array([0, 1]), Phase.DECODE)
    m.release(a)
    with pytest.raises(UserError, match="below the 200 bytes resident"):
        m.reconfigure("cpu", 150)
    assert m.capacity("cpu") == 300                           # unchanged after a refusal
    with pytest.raises(UserError):
        m.reconfigure("cpu", 0)
    m.reconfigure("cpu", 200)
    assert m.capacity("cpu") == 200
    m.verify()


def test_unresolved_device_admits_nothing_and_says_why():
    cfg = ResidencyConfig(devices=())
    m = ExpertResidencyManager(cfg)
    with pytest.raises(UserError, match="bind_model"):
        m.access_layer("cpu", 0, np.array([1]), Phase.DECODE)
    from runtime.residency.config import parse_config
    m = ExpertResidencyManager(parse_config({"devices": {"cpu": "1KiB"}}, source="t.toml"))
    m.bind_model([100] * 2, 4)
    assert "not resolved" in m.unresolved_reason("cpu")
    a = m.access_layer("cpu", 0, np.array([1, 2]), Phase.DECODE)
    assert a.transient == (K(0, 1), K(0, 2)) and a.admitted == ()
    assert m.resolve_device("cpu", free_bytes=10_000, total_bytes=20_000) == 1024
    assert m.unresolved_reason("cpu") is None
    with pytest.raises(UserError, match="unknown device"):
        m.access_layer("cuda:3", 0, np.array([1]), Phase.DECODE)
    with pytest.raises(UserError, match="out of range"):
        m.access_layer("cpu", 0, np.array([4]), Phase.DECODE)
    with pytest.raises(UserError, match="no routed experts"):
        m.access_layer("cpu", 7, np.array([0]), Phase.DECODE)


def test_resolve_device_budget_errors():
    from runtime.residency.config import parse_config
    cfg = parse_config({"devices": {"cuda:0": "80%", "cpu": "64GiB"}}, source="c.toml")
    m = ExpertResidencyManager(cfg)
    m.bind_model([100] * 2, 4)
    with pytest.raises(UserError, match="c.toml: devices.cuda:0: .*no backend"):
        m.resolve_device("cuda:0", free_bytes=None, total_bytes=None)
    with pytest.raises(UserError, match="c.toml: devices.cpu: .*above the device's total"):
        m.resolve_device("cpu", free_bytes=2**30, total_bytes=2**31)
    assert m.resolve_device("cuda:0", free_bytes=1000, total_bytes=4000) == 800
    tiny = ExpertResidencyManager(parse_config({"devices": {"cpu": "50B"}}, source="c.toml"))
    tiny.bind_model([100] * 2, 4)
    with pytest.raises(UserError, match="smaller than the model's largest expert"):
        tiny.resolve_device("cpu", free_bytes=10**6, total_bytes=10**6)


def test_transition_hits_and_prefetch_accounting():
    cfg = ResidencyConfig(phase_specific=True, decode=PhasePolicies(),
                          prefill=PhasePolicies(prefetch=PolicySpec("chunk-plan", DEPTH_1)))
    m = sim(100 * 8, config=cfg, layers=2, experts=8)
    for chunk in range(2):                  # chunk 0 routes [0,1] on both layers
        for layer in range(2):
            ids = np.array([0, 1, 0]) if chunk == 0 else np.array([2, 3])
            m.release(m.access_layer("sim", layer, ids, Phase.PREFILL))
    pre = m.snapshot().device("sim").phase(Phase.PREFILL)
    # after chunk 1 layer 0, layer 1's chunk-0 set {0, 1} was already resident: no prefetch
    assert pre.prefetch_issued == 0
    m.release(m.access_layer("sim", 0, np.array([0, 2]), Phase.DECODE))
    dec = m.snapshot().device("sim").phase(Phase.DECODE)
    assert dec.hits == 2 and dec.transition_hits == 2
    m.verify()


def test_chunk_plan_prestages_next_layer():
    cfg = ResidencyConfig(phase_specific=True, decode=PhasePolicies(),
                          prefill=PhasePolicies(prefetch=PolicySpec("chunk-plan", DEPTH_1)))
    m = sim(100 * 2, config=cfg, layers=3, experts=8)
    for layer, e in [(0, 0), (1, 5), (2, 6)]:                             # chunk 0
        m.release(m.access_layer("sim", layer, np.array([e]), Phase.PREFILL))
    assert not m.is_resident("sim", K(1, 5)) or not m.is_resident("sim", K(0, 0))
    a = m.access_layer("sim", 0, np.array([1]), Phase.PREFILL)           # chunk 1, layer 0
    m.release(a)
    assert a.evicted == (K(1, 5),)
    # chunk-plan pre-stages layer 1 with chunk 0's set {5}, evicting the older (2, 6)
    assert m.is_resident("sim", K(1, 5)) and not m.is_resident("sim", K(2, 6))
    b = m.access_layer("sim", 1, np.array([5]), Phase.PREFILL)
    assert b.hits == 1 and b.misses == 0
    m.release(b)
    snap = m.snapshot().device("sim").phase(Phase.PREFILL)
    # ... and after layer 1, layer 2 with {6} (not consumed yet)
    assert snap.prefetch_issued == 2 and snap.prefetch_used_bytes == 100
    assert m.is_resident("sim", K(2, 6))
    assert snap.prefetch_wasted_bytes == 0
    m.verify()


@pytest.mark.parametrize("policy", ["lru", "lfu"])
def test_bad_expert_id_leaves_no_trace(policy):
    m = sim(300, policy)
    m.release(m.access_layer("sim", 0, np.array([1]), Phase.DECODE))
    with pytest.raises(UserError, match="expert id 9 out of range"):
        m.access_layer("sim", 0, np.array([2, 3, 9]), Phase.DECODE)
    m.verify()
    assert m.resident_mask("sim", 0).tolist() == [False, True] + [False] * 6
    a = m.access_layer("sim", 0, np.array([2, 3]), Phase.DECODE)
    assert a.misses == 2 and a.admitted == (K(0, 2), K(0, 3))
    m.verify()


def test_declined_victims_go_back_in_order_behind_pinned_keys():
    cfg = ResidencyConfig(phase_specific=False, decode=PhasePolicies(
        admission=PolicySpec("transient-on-pressure", (("window", 100.0),))))
    m = ExpertResidencyManager(cfg)
    m.bind_model([100, 0, 150], 6)
    m.reconfigure("dev", 250)
    m.prefetch("dev", [K(0, 0)], Phase.PREFILL)                 # pinned until layer 0 runs
    m.release(m.access_layer("dev", 2, np.array([0]), Phase.PREFILL))
    a = m.access_layer("dev", 2, np.array([1]), Phase.PREFILL)  # victim (2, 0) too recent
    assert a.transient == (K(2, 1),)
    m.release(a)
    m.verify()                                                  # lru order intact
