from __future__ import annotations

from typing import Callable

import numpy as np
import pytest


def _zipf_stream(tokens: int, layers: int, experts: int, top_k: int, seed: int = 0) -> np.ndarray:
    """(tokens, layers, top_k) int64: distinct experts per token, skewed popularity."""
    rng = np.random.default_rng(seed)
    log_p = -1.0 * np.log1p(np.argsort(rng.random((layers, experts)), axis=1))
    scores = log_p[None] + rng.gumbel(size=(tokens, layers, experts))
    return np.argsort(-scores, axis=2)[:, :, :top_k].astype(np.int64)


@pytest.fixture
def zipf_stream() -> Callable[..., np.ndarray]:
    return _zipf_stream
