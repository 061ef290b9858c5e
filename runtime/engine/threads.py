"""How many CPU threads each llama_decode runs on: measured.

On a small machine the second core is not free: ggml's threads meet at a barrier after every
graph op, and when another process (or the hypervisor) takes one of them away the other waits.
At real scale on this project's 2-core VM two threads ran 1.39x one when the machine was quiet
and 0.84x beside two busy processes (docs/benchmarks/). So each phase (generation, prompt) runs
on its most (-t / -tb, else every core) or on one thread, keeps whichever is faster per token
(a moving average of the time not spent waiting for the RAM tier's reads, which the thread
count does not change and which varies most from token to token), and tries the other again now
and then, since the machine's load changes:

    tuner = ThreadTuner(decode_max=2, prompt_max=2)
    n = tuner.threads(Phase.DECODE)                           # before llama_decode
    tuner.record(Phase.DECODE, n, seconds, n_tokens)          # after it
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field

from runtime.residency.types import Phase

WARMUP = 4               # calls of each arm, taken in turn, before the choice
EXPLORE_EVERY = 16       # calls between two tries of the arm not in use
ALPHA = 0.25             # weight of a new sample in the per-token moving average
MARGIN = 0.05            # the other arm must be this much faster to take over


@dataclass
class _Arms:
    """One phase's choice between thread counts."""

    arms: tuple[int, ...]
    per_token: dict[int, float] = field(default_factory=dict)   # seconds, moving average
    samples: dict[int, int] = field(default_factory=dict)
    best: int = 0
    calls: int = 0

    def pick(self) -> int:
        if len(self.arms) == 1:
            return self.arms[0]
        self.calls += 1
        if self.calls <= WARMUP * len(self.arms):  # first: each arm in turn, WARMUP times
            return self.arms[(self.calls - 1) % len(self.arms)]
        if self.calls % EXPLORE_EVERY == 0:       # now and then, the other one again
            return next(a for a in self.arms if a != self.best)
        return self.best

    def record(self, arm: int, seconds_per_token: float) -> None:
        old = self.per_token.get(arm)
        self.per_token[arm] = seconds_per_token if old is None else \
            (1 - ALPHA) * old + ALPHA * seconds_per_token
        self.samples[arm] = self.samples.get(arm, 0) + 1
        if len(self.per_token) == len(self.arms):
            challenger = min(self.per_token, key=self.per_token.get)
            if challenger != self.best and \
                    self.per_token[challenger] < (1 - MARGIN) * self.per_token[self.best]:
                self.best = challenger


class ThreadTuner:
    """Threads per phase, between 1 and its most (see the module docstring)."""

    def __init__(self, decode_max: int | None = None, prompt_max: int | None = None):
        cores = os.cpu_count() or 1
        self.most = (max(1, decode_max or cores), max(1, prompt_max or decode_max or cores))
        self._phases = {phase: _Arms((n, 1) if n > 1 else (1,), best=n)   # most first
                        for phase, n in zip((Phase.DECODE, Phase.PREFILL), self.most)}

    def threads(self, phase: Phase) -> int:
        """The thread count for the next call of ``phase`` (a MIXED step counts as decode)."""
        return self._arms(phase).pick()

    def record(self, phase: Phase, threads: int, seconds: float, n_tokens: int) -> None:
        arms = self._arms(phase)
        if seconds > 0 and threads in arms.arms:
            arms.record(threads, seconds / max(1, n_tokens))

    def _arms(self, phase: Phase) -> _Arms:
        return self._phases[Phase.PREFILL if phase == Phase.PREFILL else Phase.DECODE]

    def current(self) -> tuple[int, int]:
        """(generation, prompt) thread counts in use: the faster so far."""
        return self._phases[Phase.DECODE].best, self._phases[Phase.PREFILL].best

    def describe(self) -> str:
        """One line for logs and benchmarks: what each phase runs on now, and why."""
        parts = []
        for name, phase, most in (("generation", Phase.DECODE, self.most[0]),
                                  ("prompt", Phase.PREFILL, self.most[1])):
            arms = self._phases[phase]
            rates = ", ".join(f"{a}: {1 / s:.1f} t/s" for a, s in sorted(arms.per_token.items())
                              if s > 0)
            parts.append(f"{name} {arms.best} of 1..{most}" + (f" ({rates})" if rates else ""))
        return "threads: " + "; ".join(parts)
