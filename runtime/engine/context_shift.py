"""Context shift (llama-server's ``--context-shift``): when a sequence's context is full, the
oldest half of what follows the first ``n_keep`` tokens is dropped from the KV cache and the
rest moves back, so generation goes on past the context size (llama.cpp's
``llama_memory_seq_rm`` + ``llama_memory_seq_add``, as llama-server does). A prompt longer
than the context is cut first (``truncate_prompt``), as llama-server does.
"""
from __future__ import annotations


def shift_plan(n_past: int, n_keep: int, n_prompt: int) -> tuple[int, int]:
    """(tokens kept at the start, tokens discarded after them) for a full sequence of
    ``n_past`` tokens; ``n_keep`` -1 keeps the whole prompt, as llama-server."""
    keep = n_prompt if n_keep < 0 else n_keep
    keep = max(0, min(keep, n_past - 2))            # something must be discarded
    return keep, max(1, (n_past - keep) // 2)


def truncate_prompt(tokens: list[int], n_ctx: int, n_keep: int) -> list[int]:
    """A prompt that does not fit the context, cut as llama-server cuts it under
    ``--context-shift``: the first ``n_keep`` tokens stay, then whole blocks of half the rest
    of the context are dropped after them until the prompt fits."""
    keep = n_keep if 0 <= n_keep < n_ctx // 2 else 0
    block = max(1, (n_ctx - keep) // 2)
    erased = (len(tokens) - keep - block) // block
    return tokens[:keep] + tokens[keep + erased * block:]


def shift(ll, ctx: int, seq: int, n_past: int, keep: int, discard: int) -> int:
    """Drop ``discard`` cells after the first ``keep`` of ``seq`` and move the rest back;
    returns the new number of tokens in the sequence."""
    memory = ll.llama_get_memory(ctx)
    ll.llama_memory_seq_rm(memory, seq, keep, keep + discard)
    ll.llama_memory_seq_add(memory, seq, keep + discard, n_past, -discard)
    return n_past - discard
