"""llama-server's ``llamacpp:*`` Prometheus families, where they map onto this server.

Counters follow llama-server's meaning (tools/server/server-context.cpp, metrics): prompt
tokens evaluated and served from the KV cache (under its older and newer name, with the
hit ratio as a gauge), their seconds, tokens predicted and their
seconds, decode calls; gauges: the mean rates over the window since the last scrape (as
llama-server's buckets: each scrape starts a new window), requests processing and deferred
(queued), busy slots per decode. There is no speculative decoding here: its families read 0.
"""
from __future__ import annotations

import re
import threading

from runtime.server.queue import QueueStats


RATES = ("prompt_tokens_seconds", "predicted_tokens_seconds")   # gauges over a scrape window
_RATE_LINE = re.compile(rf"^(llamacpp:(?:{'|'.join(RATES)})) \S+$", re.M)


def window_spent(text: str) -> str:
    """``/metrics`` text as the next scrape sees it when nothing ran since: the rates 0 (the
    text kept while the model sleeps: each scrape starts a new window, as llama-server's)."""
    return _RATE_LINE.sub(r"\1 0.0", text)


class LlamaCppCounters:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.prompt_tokens = 0          # evaluated
        self.prompt_cached = 0          # reused from the KV cache
        self.prompt_seconds = 0.0
        self.predicted = 0
        self.predicted_seconds = 0.0
        self.n_tokens_max = 0           # longest sequence seen (prompt + generated), tokens
        # the rate totals at the last scrape: (prompt tokens, their s, predicted, their s)
        self._scraped = (0, 0.0, 0, 0.0)

    def observe(self, timings, prompt_tokens: int) -> None:
        """One finished choice: its ``Timings`` and the prompt's token count."""
        if timings is None:
            return
        with self._lock:
            self.prompt_tokens += timings.prompt_tokens
            self.prompt_cached += max(0, prompt_tokens - timings.prompt_tokens)
            self.prompt_seconds += timings.prompt_s
            self.predicted += timings.completion_tokens
            self.predicted_seconds += timings.generation_s
            self.n_tokens_max = max(self.n_tokens_max, prompt_tokens + timings.completion_tokens)

    def render(self, queue: QueueStats | None, decode_calls: int, busy_per_decode: float) -> str:
        """The families as Prometheus text; the rates' window starts again."""
        with self._lock:
            c = (self.prompt_tokens, self.prompt_cached, self.prompt_seconds, self.predicted,
                 self.predicted_seconds, self.n_tokens_max)
            now = (self.prompt_tokens, self.prompt_seconds, self.predicted,
                   self.predicted_seconds)
            w_prompt, w_prompt_s, w_predicted, w_predicted_s = (
                a - b for a, b in zip(now, self._scraped))
            self._scraped = now
        prompt, cached, prompt_s, predicted, predicted_s, n_max = c
        rows = [
            ("prompt_tokens_total", "counter", "Number of prompt tokens processed.", prompt),
            ("prompt_tokens_cached_total", "counter",
             "Number of prompt tokens served from the KV cache.", cached),
            ("prompt_tokens_cache_total", "counter",
             "Number of prompt tokens served from the KV cache (llama-server's newer name).",
             cached),
            ("prompt_seconds_total", "counter", "Prompt process time.", round(prompt_s, 6)),
            ("tokens_predicted_total", "counter", "Number of generation tokens processed.",
             predicted),
            ("tokens_predicted_seconds_total", "counter", "Predict process time.",
             round(predicted_s, 6)),
            ("n_decode_total", "counter", "Total number of llama_decode() calls.", decode_calls),
            ("n_tokens_max", "counter", "Largest observed n_tokens.", n_max),
            ("spec_decode_num_draft_tokens_total", "counter",
             "Draft tokens generated (no speculative decoding here).", 0),
            ("spec_decode_num_accepted_tokens_total", "counter",
             "Draft tokens accepted (no speculative decoding here).", 0),
            ("spec_decode_num_drafts_total", "counter",
             "Drafts generated (no speculative decoding here).", 0),
            ("prompt_cache_hit_ratio", "gauge",
             "Share of prompt tokens served from the KV cache.",
             round(cached / (cached + prompt), 6) if cached + prompt else 0.0),
            ("prompt_tokens_seconds", "gauge", "Average prompt throughput in tokens/s (since "
             "the last scrape).", round(w_prompt / w_prompt_s, 3) if w_prompt_s else 0.0),
            ("predicted_tokens_seconds", "gauge", "Average generation throughput in tokens/s "
             "(since the last scrape).",
             round(w_predicted / w_predicted_s, 3) if w_predicted_s else 0.0),
            ("requests_processing", "gauge", "Number of requests processing.",
             queue.running if queue else 0),
            ("requests_deferred", "gauge", "Number of requests deferred.",
             queue.waiting if queue else 0),
            ("n_busy_slots_per_decode", "gauge", "Average number of busy slots per "
             "llama_decode() call.", round(busy_per_decode, 3)),
        ]
        lines = []
        for name, kind, help_text, value in rows:
            lines += [f"# HELP llamacpp:{name} {help_text}", f"# TYPE llamacpp:{name} {kind}",
                      f"llamacpp:{name} {value}"]
        return "\n".join(lines) + "\n"
