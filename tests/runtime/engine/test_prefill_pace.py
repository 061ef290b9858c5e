"""The prompt chunk beside generating slots (runtime/engine/prefill_pace.py): a step with
prompt rows is sized towards two decode steps from the costs the pacer saw."""
from __future__ import annotations

from runtime.engine.prefill_pace import MIN_CHUNK, TARGET_STEPS, PrefillPacer


def test_no_generating_slot_gives_the_whole_batch():
    assert PrefillPacer().budget(False, 2048) == 2048


def test_the_chunk_follows_the_cost_of_a_prompt_token():
    pacer = PrefillPacer()
    assert pacer.budget(True, 2048) == MIN_CHUNK          # nothing known: the smallest
    pacer.observe(0.010, 0, 2)                            # a decode-only step: 10 ms
    # cheap prompt tokens (a GPU: 64 tokens cost 5 ms): the chunk doubles, step by step
    chunks = []
    for _ in range(12):
        chunk = pacer.budget(True, 2048)
        chunks.append(chunk)
        pacer.observe(0.010 + chunk * 0.0001, chunk, 1)   # 0.1 ms a prompt token
    assert chunks[:4] == [1, 2, 4, 8] and chunks[-1] == 100   # (20 ms - 10 ms) / 0.1 ms
    # dear ones (a CPU MoE: a prompt token costs about a decode step): a step of a few
    for _ in range(8):
        chunk = pacer.budget(True, 2048)
        pacer.observe(0.010 + chunk * 0.010, chunk, 1)
    assert pacer.budget(True, 2048) <= TARGET_STEPS and pacer.budget(True, 3) <= 3
    assert pacer.budget(True, 2048) >= MIN_CHUNK


def test_a_step_nobody_waited_on_changes_nothing():
    pacer = PrefillPacer()
    pacer.observe(5.0, 2048, 0)                           # a prompt alone
    assert pacer.chunk == MIN_CHUNK and pacer.decode_s is None
