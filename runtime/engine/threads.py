"""How many CPU threads each llama_decode runs on: fixed when the user says (-t), else chosen
by measured speed.

On a small machine the second core is not free: ggml's threads meet at a barrier after every
graph op, and when another process (or the hypervisor) takes one of them away the other waits.
At real scale on this project's 2-core VM, two threads beat one when the machine was quiet and
lost to it beside two busy processes (docs/benchmarks/). So by default each phase (generation,
prompt) tries one thread and every core, keeps the faster per token (a moving average), and
tries the other again now and then, since the machine's load changes:

    tuner = ThreadTuner(max_threads=os.cpu_count())        # or fixed=(n, n_batch)
    n = tuner.threads(Phase.DECODE)                           # before llama_decode
    tuner.record(Phase.DECODE, n, seconds, n_tokens)          # after it
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field

from runtime.residency.types import Phase

EXPLORE_EVERY = 16       # decode calls between two tries of the arm not in use
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
        for arm in self.arms:                     # every arm measured twice first
            if self.samples.get(arm, 0) < 2:
                return arm
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
    """Threads per phase: ``fixed`` (decode, prompt) when given, else measured between 1 and
    ``max_threads`` (see the module docstring)."""

    def __init__(self, max_threads: int | None = None, *,
                 fixed: tuple[int | None, int | None] = (None, None)):
        n = max(1, max_threads or os.cpu_count() or 1)
        self.max_threads = n
        self.fixed = fixed
        arms = (n, 1) if n > 1 else (1,)          # measured in this order: every core first
        self._phases = {Phase.DECODE: _Arms(arms, best=n), Phase.PREFILL: _Arms(arms, best=n)}

    def threads(self, phase: Phase) -> int:
        """The thread count for the next call of ``phase`` (a MIXED step counts as decode)."""
        i = 1 if phase == Phase.PREFILL else 0
        if self.fixed[i] is not None:
            return self.fixed[i]
        return self._phases[Phase.PREFILL if i else Phase.DECODE].pick()

    def record(self, phase: Phase, threads: int, seconds: float, n_tokens: int) -> None:
        i = 1 if phase == Phase.PREFILL else 0
        if self.fixed[i] is not None or seconds <= 0:
            return
        arms = self._phases[Phase.PREFILL if i else Phase.DECODE]
        if threads in arms.arms:
            arms.record(threads, seconds / max(1, n_tokens))

    def current(self) -> tuple[int, int]:
        """(generation, prompt) thread counts in use: the fixed ones, or the faster so far."""
        return tuple(self.fixed[i] if self.fixed[i] is not None else self._phases[p].best
                     for i, p in ((0, Phase.DECODE), (1, Phase.PREFILL)))

    def describe(self) -> str:
        """One line for logs and --verbose: what each phase runs on now."""
        parts = []
        for name, i, phase in (("generation", 0, Phase.DECODE), ("prompt", 1, Phase.PREFILL)):
            if self.fixed[i] is not None:
                parts.append(f"{name} {self.fixed[i]} (-t)")
                continue
            arms = self._phases[phase]
            rates = ", ".join(f"{a}: {1 / s:.1f} t/s" for a, s in sorted(arms.per_token.items())
                              if s > 0)
            parts.append(f"{name} {arms.best} of 1..{self.max_threads}"
                         + (f" ({rates})" if rates else ""))
        return "threads: " + "; ".join(parts)
