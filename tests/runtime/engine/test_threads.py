"""The thread tuner: each phase runs on whichever of 1 and its most (-t, else every core)
measures faster per token, and follows the machine when its load changes."""
from __future__ import annotations

from runtime.engine.threads import EXPLORE_EVERY, WARMUP, ThreadTuner
from runtime.residency.types import Phase


def _run(tuner: ThreadTuner, phase: Phase, seconds_per_token: dict[int, float], calls: int,
         tokens: int = 1) -> list[int]:
    used = []
    for _ in range(calls):
        n = tuner.threads(phase)
        used.append(n)
        tuner.record(phase, n, seconds_per_token[n] * tokens, tokens)
    return used


def test_one_thread_at_most_is_one_thread():
    tuner = ThreadTuner(1, 1)
    assert _run(tuner, Phase.DECODE, {1: 1.0}, 40) == [1] * 40
    assert _run(tuner, Phase.PREFILL, {1: 1.0}, 5) == [1] * 5
    assert tuner.current() == (1, 1)


def test_prompts_default_to_the_generation_most():
    tuner = ThreadTuner(3)
    assert tuner.most == (3, 3)
    assert _run(tuner, Phase.PREFILL, {3: 0.1, 1: 0.2}, 20)[:4] == [3, 1, 3, 1]


def test_the_faster_count_wins_and_the_other_is_tried_again_now_and_then():
    tuner = ThreadTuner(2)
    used = _run(tuner, Phase.DECODE, {2: 0.10, 1: 0.15}, 200)
    assert used[:8] == [2, 1] * 4                     # in turn, every core first
    assert tuner.current()[0] == 2
    tries = used[2 * WARMUP:].count(1)
    assert 0 < tries <= 200 // EXPLORE_EVERY + 1      # explored, not used
    # the machine gets busy: one thread is now faster, and the tuner follows
    used = _run(tuner, Phase.DECODE, {2: 0.30, 1: 0.16}, 200)
    assert tuner.current()[0] == 1
    assert used[-50:].count(1) >= 50 - 50 // EXPLORE_EVERY - 1


def test_a_small_difference_does_not_flip_the_choice():
    tuner = ThreadTuner(2)
    _run(tuner, Phase.DECODE, {2: 0.100, 1: 0.102}, 300)     # 2% apart: within the margin
    assert tuner.current()[0] == 2


def test_phases_are_tuned_apart_and_per_token():
    tuner = ThreadTuner(4, 4)
    _run(tuner, Phase.PREFILL, {4: 0.01, 1: 0.03}, 30, tokens=512)   # prompts: all cores
    _run(tuner, Phase.DECODE, {4: 0.20, 1: 0.12}, 60)                # generation: one
    assert tuner.current() == (1, 4)
    assert "generation 1 of 1..4" in tuner.describe() and "prompt 4 of 1..4" in tuner.describe()
