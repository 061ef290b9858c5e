"""The batch scheduler's choice of a slot for a new request: the free sequence whose KV holds
the longest prefix of the prompt (never the whole prompt: its last token gives the logits)."""
from __future__ import annotations

from runtime.engine.slot_choice import best_slot


def test_longest_shared_prefix_wins():
    cached = {0: [1, 2, 9], 1: [1, 2, 3, 4, 5], 2: []}
    assert best_slot([0, 1, 2], cached, [1, 2, 3, 4, 7]) == (1, 4)
    assert best_slot([0, 2], cached, [1, 2, 3, 4, 7]) == (0, 2)      # slot 1 is busy


def test_the_last_prompt_token_is_evaluated_again():
    assert best_slot([0], {0: [1, 2, 3, 4]}, [1, 2, 3]) == (0, 2)


def test_a_tie_takes_the_lowest_id():
    assert best_slot([2, 1], {1: [5], 2: [5]}, [5, 6]) == (1, 1)
    assert best_slot([3, 1], {1: [], 3: []}, [5, 6]) == (1, 0)
