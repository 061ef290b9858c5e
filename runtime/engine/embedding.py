"""Embeddings of a prompt from an engine whose context was made for them
(``EngineSettings(embeddings=True, pooling=...)``), as llama-server's ``--embedding``: one
decode of the whole input (through the same routing hook, so the residency manager sees it),
then the pooled vector of the sequence, or one vector per token with pooling ``none``; with
pooling ``rank`` (``--reranking``) the sequence's score instead (``rank_score``).

    vectors = embed(engine, engine.tokenize("hello"))     # [[n_embd floats]] when pooled
"""
from __future__ import annotations

from typing import Any

import numpy as np

from runtime.engine.types import NonFiniteLogits
from runtime.errors import UserError
from runtime.residency.types import Phase

POOLING_NONE = 0       # LLAMA_POOLING_TYPE_NONE
POOLING_RANK = 4       # LLAMA_POOLING_TYPE_RANK: a reranker's score per sequence


def pooled(engine: Any) -> bool:
    return int(engine._ll.llama_pooling_type(engine.ctx_ptr)) != POOLING_NONE  # noqa: SLF001


def ranks(engine: Any) -> bool:
    return int(engine._ll.llama_pooling_type(engine.ctx_ptr)) == POOLING_RANK  # noqa: SLF001


def _check_fits(engine: Any, tokens: list[int]) -> None:
    if not tokens:
        raise UserError("Input content cannot be empty")
    if len(tokens) > engine.n_batch:
        raise UserError(f"input ({len(tokens)} tokens) is too large to process. increase the "
                        f"physical batch size (-b, now {engine.n_batch})")


def rank_score(engine: Any, tokens: list[int]) -> float:
    """A reranker's score of one (query, document) prompt: the first of the ``n_cls_out``
    values llama.cpp's rank pooling gives the sequence (llama-server's ``embd[0]``)."""
    _check_fits(engine, tokens)
    ll, ctx = engine._ll, engine.ctx_ptr  # noqa: SLF001
    with engine._busy:  # noqa: SLF001
        engine._use_lora(None)  # noqa: SLF001 - the global LoRA scales
        engine._forget_from(0)  # noqa: SLF001
        try:
            engine._decode(list(tokens), 0, Phase.PREFILL)  # noqa: SLF001
            row = ll.llama_get_embeddings_seq(ctx, 0)
            if not row:
                raise RuntimeError("llama.cpp returned no rank score for this input")
            score = float(row[0])
        finally:
            engine._forget_from(0)  # noqa: SLF001 - the next input starts afresh
    if not np.isfinite(score):
        raise NonFiniteLogits("the model's rank score is not finite (NaN or Inf): its weights "
                              "are broken")
    return score


def embed(engine: Any, tokens: list[int], normalize: int = 2) -> list[list[float]]:
    """The input's embedding (pooled: one vector, normalized as llama.cpp's
    ``common_embd_normalize``: -1 none, 0 int16 max-abs, 1 taxicab, 2 euclidean, p > 2
    p-norm) or its tokens' (pooling none: raw, one per token)."""
    _check_fits(engine, tokens)
    if ranks(engine):          # one score per sequence, not n_embd values: /rerank reads it
        raise UserError("this server ranks (--reranking): its pooled output is a score, not "
                        "an embedding; use /rerank")
    ll, ctx = engine._ll, engine.ctx_ptr  # noqa: SLF001 - embedding is the engine's other use
    n_embd = int(ll.llama_model_n_embd(engine.model_ptr))
    with engine._busy:  # noqa: SLF001
        engine._use_lora(None)  # noqa: SLF001 - the global LoRA scales
        engine._forget_from(0)  # noqa: SLF001
        try:
            engine._decode(list(tokens), 0, Phase.PREFILL)  # noqa: SLF001
            rows = [ll.llama_get_embeddings_seq(ctx, 0)] if pooled(engine) else \
                [ll.llama_get_embeddings_ith(ctx, i) for i in range(len(tokens))]
            if any(not row for row in rows):
                raise RuntimeError("llama.cpp returned no embeddings for this input")
            vectors = [np.ctypeslib.as_array(row, shape=(n_embd,)).astype(np.float64)
                       for row in rows]                       # each (n_embd,)
            if not all(np.isfinite(v).all() for v in vectors):   # JSON cannot carry them
                raise NonFiniteLogits("the model's embedding is not finite (NaN or Inf): "
                                      "its weights are broken")
        finally:
            engine._forget_from(0)  # noqa: SLF001 - the next input starts afresh
    if len(rows) == 1 and pooled(engine):
        vectors = [normalized(vectors[0], normalize)]
    return [v.tolist() for v in vectors]


def normalized(v: np.ndarray, norm: int) -> np.ndarray:
    """llama.cpp's common_embd_normalize."""
    if norm < 0:
        return v
    if norm == 0:
        scale = np.abs(v).max() / 32760.0
    elif norm == 2:
        scale = float(np.sqrt((v * v).sum()))
    else:
        scale = float((np.abs(v) ** norm).sum() ** (1.0 / norm))
    return v / scale if scale > 0 else v * 0.0
