"""A sampled token with its log-probabilities: the model's (log-softmax of the raw logits,
OpenAI's logprobs) or the sampler chain's survivors' (llama-server's post_sampling_probs).
Shared by ``Engine.generate`` and the batch scheduler."""
from __future__ import annotations

import math
from typing import Any

from runtime.engine.sampling import Sampler, SamplingParams
from runtime.engine.types import NonFiniteLogits, TokenLogprob


def sample_token(engine: Any, sampler: Sampler, index: int,
                 params: SamplingParams) -> tuple[int, TokenLogprob | None]:
    """Sample from ``engine``'s output row ``index`` (-1: the last); with ``params.logprobs``,
    also the token's logprob and top k: the model's, or the sampler chain's survivors'
    (``post_sampling``)."""
    check_finite(engine, index)
    if params.logprobs is None:
        return sampler.sample(engine.ctx_ptr, index), None
    logits = last_logits(engine, index)
    if not params.post_sampling:
        token = sampler.sample(engine.ctx_ptr, index)
        return token, model_logprob(engine, logits, token, params.logprobs)
    token, p_token, left = sampler.sample_candidates(logits, params.logprobs)
    log = lambda p: math.log(p) if p > 0 else -math.inf  # noqa: E731
    return token, TokenLogprob(token, engine.token_bytes(token), log(p_token),
                               tuple((t, engine.token_bytes(t), log(p)) for t, p in left))


def check_finite(engine: Any, index: int = -1) -> None:
    """``NonFiniteLogits`` unless every logit of output row ``index`` is finite: a NaN row
    samples some token (greedy: id 0, often end-of-generation: an empty answer) and its
    logprobs are NaN, which JSON cannot carry. One pass over n_vocab floats, no copy."""
    import numpy as np  # noqa: PLC0415

    ptr = engine._ll.llama_get_logits_ith(engine.ctx_ptr, index)  # noqa: SLF001
    if not ptr:
        raise RuntimeError(f"llama.cpp has no logits for output {index}")
    row = np.ctypeslib.as_array(ptr, shape=(engine.n_vocab,))      # (n_vocab,) float32 view
    if np.isfinite(row.sum(dtype=np.float32)):    # the fast test: a NaN or Inf spreads
        return
    bad = int((~np.isfinite(row)).sum())          # else count (a finite sum may overflow)
    if bad:
        raise NonFiniteLogits(f"the model's logits are not finite ({bad} of {row.size} NaN "
                              "or Inf): its weights or its KV state are broken; nothing was "
                              "sampled")


def last_logits(engine: Any, index: int = -1):
    """(n_vocab,) float32 copy of output row ``index``'s raw logits (-1: the last)."""
    import numpy as np  # noqa: PLC0415

    ptr = engine._ll.llama_get_logits_ith(engine.ctx_ptr, index)  # noqa: SLF001
    return np.ctypeslib.as_array(ptr, shape=(engine.n_vocab,)).copy()


def model_logprob(engine: Any, logits, token: int, k: int) -> TokenLogprob:
    """``token``'s log-softmax under ``logits`` ((n_vocab,)) and the ``k`` most likely."""
    import numpy as np  # noqa: PLC0415

    shifted = logits.astype(np.float64) - float(logits.max())
    logp = shifted - np.log(np.exp(shifted).sum())          # (n_vocab,) log-softmax
    top: tuple = ()
    if k > 0:
        best = np.argpartition(-logp, k - 1)[:k]
        best = best[np.argsort(-logp[best], kind="stable")]
        top = tuple((int(t), engine.token_bytes(int(t)), float(logp[t])) for t in best)
    return TokenLogprob(token, engine.token_bytes(token), float(logp[token]), top)
