"""The RAM tier's page cache within its budget throughout, one-use reads included: a prompt
routes to every expert of each layer, the experts the core does not keep (transient uses) are
read for the layer's matmul, and mincore over the file's expert ranges, taken after each
layer-step's reads, never passes the budget. Real llama.cpp on a synthetic model."""
from __future__ import annotations

import logging

import numpy as np
import pytest

from gguf_tools.synth import SynthSpec
from runtime.engine.engine import Engine, EngineSettings, SamplingParams
from runtime.ramtier import RamTier, TierStats, split_budget
from runtime.ramtier.vm import PAGE_SIZE
from runtime.residency.config import parse_config
from runtime.residency.types import Phase

MIB = 1 << 20
# 4 layers x 16 experts x 1.5 MiB (f32 gate/up/down 256 x 512), top-4, even popularity: a
# 60-token prompt's ubatch routes to every expert of every layer
SPEC = SynthSpec(arch="qwen3moe", layers=4, experts=16, top_k=4, embd=256, ff=512,
                 dtype="f32", seed=5, skew=0.0)
EXPERT = 3 * 256 * 512 * 4
LAYER = 16 * EXPERT                     # the one-use room: every expert of one layer
TOTAL = 4 * LAYER
PROMPT = " ".join(["the river ran past old houses and a mill"] * 6)


@pytest.fixture(scope="module")
def model(synth_model_factory):
    return str(synth_model_factory(SPEC))


class _PageCacheProbe:
    """Runs after the tier on every layer-step: the model's expert bytes in the page cache
    (mincore over every expert range, as scripts/bench_router.py counts them)."""

    def __init__(self, tier: RamTier):
        self.tier = tier
        self.peak = 0
        self.widest = 0                   # most distinct experts one layer-step used

    def _look(self) -> None:
        pages = self.tier.pager.mapping.resident_pages()
        self.peak = max(self.peak, int(self.tier.layout.resident_bytes(pages).sum()))

    def on_route(self, event) -> None:
        self.widest = max(self.widest, len(np.unique(event.experts)))
        self._look()

    def on_batch_end(self, phase: Phase, n_tokens: int) -> None:
        self._look()


def _run(model: str, config: dict, n: int = 4) -> tuple[RamTier, _PageCacheProbe, TierStats,
                                                        str]:
    """(the tier, its probe, its stats, its /metrics text) after a prompt and ``n`` greedy
    tokens."""
    settings = EngineSettings(model_path=model, n_ctx=256, n_threads=1, seed=0,
                              manage_residency=True,
                              config=parse_config(config, source="test"))
    with Engine(settings, progress=False) as engine:
        tier = next(p for p in engine._attached if isinstance(p, RamTier))
        # every layer-step waits for its reads (no matmul hook): the probe, which runs after
        # the step, then sees the layer's kept and one-use experts all in, the moment its
        # matmul would see them
        tier.io.set_async(False)
        probe = _PageCacheProbe(tier)
        engine.add_route_observer(probe)
        out = [c.token for c in engine.generate(PROMPT, SamplingParams(max_tokens=n,
                                                                       temperature=0))]
        assert len([t for t in out if t is not None]) == n
        stats, metrics = tier.stats(), tier.to_prometheus()
    return tier, probe, stats, metrics


def _slack(budget: int) -> int:
    # whole pages: an expert's three ranges are not page-aligned (GGUF aligns tensors to 32
    # bytes), so each resident expert may bring in the edge pages it shares with a neighbour
    return 2 * PAGE_SIZE * 3 * (budget // EXPERT + 16)


def test_one_use_reads_stay_within_the_budget(model):
    # transient-on-pressure refuses admissions whose victim was just used: once the budget is
    # full, a prompt's layer-step reads most of its experts for one use (before the room,
    # 60 MiB kept + up to a layer's 24 MiB of one-use reads were in the page cache at once)
    config = {"devices": {"cpu": "60MiB"},
              "policy": {phase: {"admission": "transient-on-pressure"}
                         for phase in ("prefill", "decode")}}
    tier, probe, stats, metrics = _run(model, config)
    assert probe.widest == 16                          # a layer-step used every expert
    assert tier.budget_bytes == 60 * MIB
    assert tier.manager.capacity("cpu") == 60 * MIB - LAYER     # kept + room = budget
    assert probe.peak > 40 * MIB                       # the budget was really used
    assert probe.peak <= tier.budget_bytes + _slack(tier.budget_bytes), \
        f"{probe.peak / MIB:.1f} MiB of experts in RAM, budget {tier.budget_bytes / MIB} MiB"
    assert 0 < stats.one_use_peak_bytes <= LAYER       # the tier's own account of the room
    assert f"moe_ramtier_one_use_peak_bytes {stats.one_use_peak_bytes}\n" in metrics


def test_a_budget_below_one_layer_is_raised_to_what_one_layer_step_needs(model, caplog):
    # 20 MiB cannot hold a prompt's layer-step (24 MiB of experts, the kept ones included):
    # raised, with a message, to a decode's working set kept + the room; the page cache
    # stays within that (before: the 20 MiB budget and 4.5 MiB of one-use reads above it)
    caplog.set_level(logging.WARNING, logger="moe_offload.ramtier")
    tier, probe, _, _ = _run(model, {"devices": {"cpu": "20MiB"}})
    assert probe.widest == 16
    assert tier.budget_bytes == 4 * EXPERT + LAYER and \
        tier.manager.capacity("cpu") == 4 * EXPERT
    assert any("plus one layer's one-use reads" in r.getMessage() and "using 30.0 MiB"
               in r.getMessage() for r in caplog.records)
    assert probe.peak <= tier.budget_bytes + _slack(tier.budget_bytes), \
        f"{probe.peak / MIB:.1f} MiB of experts in RAM, budget {tier.budget_bytes / MIB} MiB"


def test_a_budget_for_every_expert_is_kept_whole(model):
    # nothing is read for one use when every expert fits: the decisions are as before
    tier, probe, stats, _ = _run(model, {"devices": {"cpu": f"{TOTAL // MIB}MiB"}})
    assert tier.manager.capacity("cpu") == TOTAL == tier.budget_bytes
    assert probe.peak <= TOTAL
    assert stats.one_use_peak_bytes == 0     # no eviction, no one-use read


@pytest.mark.parametrize(("budget", "want"), [
    (100, (100, 100, None)),          # every expert fits: whole, unbounded
    (80, (80, 80, None)),             # exactly every expert
    (60, (60, 40, 20)),               # kept + room = budget
    (30, (30, 10, 20)),               # working set (10) + room: the floor itself
    (12, (30, 10, 20)),               # below the floor: raised
])
def test_split_budget(budget, want):
    split = split_budget(budget, total=80, working_set=10, room=20)
    assert (split.budget, split.kept, split.room) == want


def test_split_budget_never_raises_past_every_expert():
    split = split_budget(5, total=25, working_set=10, room=20)
    assert (split.budget, split.kept, split.room) == (25, 25, None)
