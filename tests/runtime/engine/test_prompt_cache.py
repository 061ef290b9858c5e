"""The prompt cache's bookkeeping and choice (runtime/engine/prompt_cache.py), no llama.cpp:
what it stores, drops and picks, against llama-server's rules (server-task.cpp)."""
from __future__ import annotations

import pytest

from runtime.engine.prompt_cache import PromptCache


def test_store_drops_entries_it_holds_and_refuses_what_is_held():
    cache = PromptCache(0)
    cache.store([1, 2, 3], b"abc")
    assert not cache.can_store([1, 2], 2)          # held whole by [1, 2, 3]
    assert not cache.can_store([], 0)
    cache.store([1, 2, 3, 4], b"abcd")             # holds [1, 2, 3]: that one goes
    assert [e.tokens for e in cache.entries()] == [(1, 2, 3, 4)]
    cache.store([9], b"z")
    assert cache.size_bytes == 5 and len(cache) == 2


def test_limit_drops_the_oldest_and_refuses_a_state_over_it():
    cache = PromptCache(10)
    cache.store([1], b"x" * 4)
    cache.store([2], b"x" * 4)
    assert not cache.can_store([3], 11)
    cache.store([3], b"x" * 4)                     # 12 > 10: [1] goes
    assert [e.tokens for e in cache.entries()] == [(2,), (3,)]
    assert cache.size_bytes <= 10
    with pytest.raises(ValueError):
        PromptCache(-1)


def test_best_for_wants_more_kept_and_more_shared_than_the_slot():
    cache = PromptCache(0)
    cache.store([1, 2, 3, 4, 5, 6, 7, 8], b"a")    # the long conversation
    cache.store([1, 9], b"b")
    prompt = [1, 2, 3, 4, 5, 6, 7, 8, 10]
    assert cache.best_for(prompt, []) == 0          # an empty slot: the best entry
    assert cache.best_for(prompt, [1, 2, 3, 4, 5, 6, 7, 8, 10, 11]) is None  # slot is better
    assert cache.best_for([1, 9, 9], [5]) == 1
    # an entry the prompt would keep under a quarter of is never loaded
    cache.store([4, 4, 4, 4, 4, 4, 4, 4, 4], b"c")
    assert cache.best_for([4, 5], []) is None
    entry = cache.take(0)
    assert entry.tokens == (1, 2, 3, 4, 5, 6, 7, 8) and len(cache) == 2
    assert (cache.stored, cache.loaded) == (3, 1)
