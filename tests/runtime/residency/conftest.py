from __future__ import annotations

from typing import Callable

import numpy as np
import pytest

from runtime.residency.config import CostParams
from runtime.residency.policies.factory import policy_entry, policy_names

# [cost] rates scaled to the synthetic cores' 100-150 byte experts, so what prefetch affinity's
# link carries while a layer-step's experts compute (core/models/affinity.h) is a few experts'
# worth: a hit of a 100-byte expert gives it 100 bytes (GPU streams at the link's rate), a miss
# 200 (computed on the CPU at half that); a transfer costs 5 bytes of latency
TINY_COST = CostParams(link_gbps=25.0, link_latency_us=0.0002, gpu_mem_gbps=25.0,
                       cpu_mem_gbps=12.5)


def live_policies(role: str) -> list[str]:
    """The registry's policies of ``role`` that run live (not offline: they need no future),
    in its order: what a test that runs every policy reads, so a new one is in it."""
    return [name for name in policy_names(role) if not policy_entry(role, name).offline]


def _zipf_stream(tokens: int, layers: int, experts: int, top_k: int, seed: int = 0) -> np.ndarray:
    """(tokens, layers, top_k) int64: distinct experts per token, skewed popularity."""
    rng = np.random.default_rng(seed)
    log_p = -1.0 * np.log1p(np.argsort(rng.random((layers, experts)), axis=1))
    scores = log_p[None] + rng.gumbel(size=(tokens, layers, experts))
    return np.argsort(-scores, axis=2)[:, :, :top_k].astype(np.int64)


@pytest.fixture
def zipf_stream() -> Callable[..., np.ndarray]:
    return _zipf_stream
