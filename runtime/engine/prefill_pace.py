"""How many prompt tokens one batch step may carry while other slots are generating.

A step is one ``llama_decode`` of every row in it: a prompt chunk of n_batch tokens in the
same step holds every generating slot for the whole chunk's prefill (a 2008-token prompt
stalled another stream by 7.6 s, 1160 decode steps, on a CPU; scripts/stall_bench.py).
While some slot generates, the chunk is sized so that a step costs about two decode steps
(``TARGET_STEPS``): the others' next token waits at most about one decode step more. The
pacer learns as it goes: a moving average of the decode-only steps' time, and after each
step with prompt rows, the chunk whose prompt tokens (at that step's cost per token beyond
a decode step) fill the target (at most doubled at a time; never under ``MIN_CHUNK``, so a
prompt always progresses). On a CPU a
MoE prompt token costs nearly a decode step of its own (each brings its own experts), so
the chunk stays a few tokens; where a batch amortises (a GPU) it grows to hundreds. With no
slot generating a prompt takes the whole batch.
"""
from __future__ import annotations

MIN_CHUNK = 1           # prompt tokens a step always carries (when a prompt has them)
TARGET_STEPS = 2.0      # a step with prompt rows should cost this many decode steps
_ALPHA = 0.2            # weight of the newest decode-only step in the moving average


class PrefillPacer:
    def __init__(self) -> None:
        self.decode_s: float | None = None        # a decode-only step
        self.chunk = MIN_CHUNK                    # prompt tokens per step beside generation

    def budget(self, generating: bool, room: int) -> int:
        """Prompt tokens the next step may carry (``room``: the batch's free rows)."""
        return min(room, self.chunk) if generating else room

    def observe(self, seconds: float, prompt_tokens: int, decode_rows: int) -> None:
        """A step took ``seconds`` for ``prompt_tokens`` prompt rows and ``decode_rows``
        generated ones."""
        if prompt_tokens == 0:
            if decode_rows:
                self.decode_s = seconds if self.decode_s is None else \
                    (1 - _ALPHA) * self.decode_s + _ALPHA * seconds
            return
        if not decode_rows:
            return                                # nobody waited on this step
        if self.decode_s is None:                 # no decode-only step yet: an upper bound
            self.decode_s = seconds
        per_token = max(seconds - self.decode_s, 1e-9) / prompt_tokens
        fits = (TARGET_STEPS - 1) * self.decode_s / per_token
        self.chunk = max(MIN_CHUNK, min(int(fits), 2 * prompt_tokens))
