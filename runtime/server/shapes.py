"""The JSON shapes of answers: OpenAI's logprobs (chat and completions), choices, usage, and
llama-server's timings."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from runtime.engine.types import PromptProgress, Timings, TokenLogprob
from runtime.server.lifecycle import WAKE_SECONDS


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def _text(piece: bytes) -> str:
    return piece.decode("utf-8", errors="replace")


def chat_logprob(lp: TokenLogprob) -> dict[str, Any]:
    """One entry of ``choices[].logprobs.content``."""
    return {"token": _text(lp.piece), "logprob": lp.logprob, "bytes": list(lp.piece),
            "top_logprobs": [{"token": _text(p), "logprob": v, "bytes": list(p)}
                             for _, p, v in lp.top]}


def completion_logprobs(items: list[TokenLogprob], offset: int) -> dict[str, Any]:
    """``choices[].logprobs`` of a text completion; ``offset``: text before the first token."""
    offsets, at = [], offset
    for lp in items:
        offsets.append(at)
        at += len(_text(lp.piece))
    return {"tokens": [_text(lp.piece) for lp in items],
            "token_logprobs": [lp.logprob for lp in items],
            "top_logprobs": [{_text(p): v for _, p, v in lp.top} for lp in items],
            "text_offset": offsets}


@dataclass
class ChoiceResult:
    """One finished choice of a non-streamed answer."""

    index: int
    pieces: list[str] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    completion_tokens: int = 0
    tokens: list[int] = field(default_factory=list)
    timings: Any = None

    @property
    def text(self) -> str:
        return "".join(self.pieces)


def llama_timings(t: Any, n_prompt: int) -> dict:
    """llama-server's timings. The first token comes from the prompt's last logits, so the
    generation rate is over the n - 1 decode steps after it (0 for one token). A request
    that waited for its model to load or wake also gets ``wake_ms`` (ours: lifecycle.py)."""
    if t is None:
        return {}
    prompt_ms, predicted_ms = t.prompt_s * 1e3, t.generation_s * 1e3
    steps = t.completion_tokens - 1
    waited = WAKE_SECONDS.get()
    return ({"wake_ms": waited * 1e3} if waited is not None else {}) | {"cache_n": max(0, n_prompt - t.prompt_tokens), "prompt_n": t.prompt_tokens,
            "prompt_ms": prompt_ms,
            "prompt_per_token_ms": prompt_ms / t.prompt_tokens if t.prompt_tokens else 0.0,
            "prompt_per_second": t.prompt_tps, "predicted_n": t.completion_tokens,
            "predicted_ms": predicted_ms,
            "predicted_per_token_ms": predicted_ms / steps if steps > 0 and predicted_ms else 0.0,
            "predicted_per_second": 1e3 / predicted_ms * steps
            if steps > 0 and predicted_ms else 0.0}


def prompt_progress(report: Any) -> dict:
    """llama-server's ``prompt_progress`` from a ``PromptProgress``."""
    return {"total": report.total, "cache": report.cached, "processed": report.processed,
            "time_ms": report.elapsed_s * 1e3}


def progress_timings(report: Any) -> dict:
    """llama-server's timings while the prompt is evaluated (nothing predicted yet)."""
    return llama_timings(Timings(prompt_tokens=report.processed - report.cached,
                                 prompt_s=report.elapsed_s, completion_tokens=0,
                                 generation_s=0.0), report.processed)


class RunningTimings:
    """timings_per_token: a stream's timings so far, from the prompt's last progress report
    (``prompt``) and the clock since the first token (the final event has the engine's)."""

    def __init__(self, n_prompt: int) -> None:
        self.n_prompt = n_prompt
        self.prompt: PromptProgress | None = None
        self._t_first: float | None = None

    def now(self, n: int) -> dict:
        """The timings after ``n`` generated tokens."""
        t = time.perf_counter()
        self._t_first = self._t_first or t
        p = self.prompt
        return llama_timings(Timings(
            prompt_tokens=p.processed - p.cached if p else 0, prompt_s=p.elapsed_s if p else 0.0,
            completion_tokens=n, generation_s=t - self._t_first), self.n_prompt)
