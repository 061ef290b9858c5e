"""The C residency core and its Python reference side by side (test_core_reference.py,
test_learned_reference.py): a small model's shape, a CorePolicy from one (name, parameters) per
role, a pair of cores (native, reference) built from it, and their whole state compared."""
from __future__ import annotations

import numpy as np

from runtime.residency.config import PhasePolicies, ResidencyConfig
from runtime.residency.core import CorePolicy
from runtime.residency.cores import make_core
from runtime.residency.policies.factory import make_spec
from tests.runtime.residency.conftest import TINY_COST

NO_PREFETCH = ("none", {})
POPULARITY = ("popularity", {"top_n": 2.0})
# TINY_COST: a transfer costs its bytes + 5; a layer-step of 2 experts gives the link 200-600
# bytes of time. 150 bytes per typical layer-step: a lead of 2 MoE layers (ceil(2 * 155 / 150)
# = 3, at most n_moe - 1); 500 bytes per typical layer-step: the next layer (lead 1)
AFFINITY_LEAD2 = ("affinity", {"top_n": 2.0, "min_precision": 0.2, "layer_us": 0.006})
AFFINITY_LEAD1 = ("affinity", {"top_n": 2.0, "min_precision": 0.2, "layer_us": 0.02})
N_LAYER, N_EXPERT = 4, 6
EXPERT_BYTES = [100, 0, 150, 100]          # a dense layer, two expert sizes
MOE = [0, 2, 3]


def policy(ev, ad, pf, ev2=None) -> CorePolicy:
    def phase(e):
        return PhasePolicies(admission=make_spec("admission", ad[0], ad[1]),
                             prefetch=make_spec("prefetch", pf[0], pf[1]),
                             eviction=make_spec("eviction", e[0], e[1]))
    cfg = ResidencyConfig(phase_specific=ev2 is not None, prefill=phase(ev2 or ev),
                          decode=phase(ev), cost=TINY_COST)
    return CorePolicy.from_config(cfg)


def pair(pol: CorePolicy):
    return [make_core(kind, N_LAYER, N_EXPERT, EXPERT_BYTES, pol)
            for kind in ("native", "reference")]


def same_state(cores) -> None:
    native, ref = cores
    assert np.array_equal(native.states(), ref.states())
    assert native.n_pool == ref.n_pool
    for p in range(native.n_pool):
        assert native.pool_stats(p) == ref.pool_stats(p)
        for ph in range(3):
            assert native.counters(p, ph) == ref.counters(p, ph)
    assert native.verify() == 0 and ref.verify() == 0
    assert native.n_leases == ref.n_leases
