"""Which free slot a new request takes: the one whose KV already holds the longest prefix
of its prompt (llama-server's slot choice by prompt similarity, here by exact prefix)."""
from __future__ import annotations

from collections.abc import Sequence

from runtime.engine.prompt_cache import common_prefix


def best_slot(free: Sequence[int], cached: dict[int, list[int]],
              tokens: list[int]) -> tuple[int, int]:
    """The free sequence whose KV shares the longest prefix with ``tokens`` (the lowest id on
    a tie) and how many tokens of it to keep: never the whole prompt, since its last token is
    evaluated again to give the logits to sample from."""
    seq = max(sorted(free), key=lambda s: shared_prefix(cached.get(s, []), tokens, cap=False))
    return seq, shared_prefix(cached.get(seq, []), tokens)  # max keeps the lowest of equals


def shared_prefix(cached: list[int], tokens: list[int], cap: bool = True) -> int:
    """Tokens at the start of ``tokens`` that ``cached`` holds; with ``cap``, at most all
    but the last (it is evaluated again for the logits to sample from)."""
    n = common_prefix(cached, tokens)
    return min(n, len(tokens) - 1) if cap else n
