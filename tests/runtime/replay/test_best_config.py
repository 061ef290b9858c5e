"""configs/best-replay.toml keeps its promise: fewer decode demand-miss bytes than lru and lfu
in every cell of both real traces at 10 / 20 / 30 % capacity."""
from __future__ import annotations

from pathlib import Path

import pytest

from runtime.replay.harness import replay_cell
from runtime.residency.config import load_config, preset_config

BEST = Path(__file__).resolve().parents[3] / "configs" / "best-replay.toml"


@pytest.mark.parametrize("share", [0.10, 0.20, 0.30])
def test_best_config_beats_lru_and_lfu(real_prep, share):
    capacity = int(share * real_prep.trace.header.total_expert_bytes)
    best = replay_cell(real_prep, capacity, load_config(BEST), label="best", with_belady=False)
    for name in ("lru", "lfu"):
        other = replay_cell(real_prep, capacity, preset_config(name), label=name,
                            with_belady=False)
        assert best.decode.demand_miss_bytes < other.decode.demand_miss_bytes, name


@pytest.mark.parametrize("share", [0.10, 0.20, 0.30])
def test_next_visit_beats_lru_and_best_moves_no_more_than_lru(real_prep, share):
    """decode's default eviction (next-visit) misses fewer decode bytes than lru in every cell;
    the best config's prefetch moves at most 1.15x lru's bytes (the issue's bound)."""
    capacity = int(share * real_prep.trace.header.total_expert_bytes)
    nv = replay_cell(real_prep, capacity, preset_config("next-visit"), label="next-visit",
                     with_belady=False)
    lru = replay_cell(real_prep, capacity, preset_config("lru"), label="lru", with_belady=False)
    best = replay_cell(real_prep, capacity, load_config(BEST), label="best", with_belady=False)
    assert nv.decode.demand_miss_bytes < lru.decode.demand_miss_bytes
    assert best.decode.bytes_moved <= 1.15 * lru.decode.bytes_moved
