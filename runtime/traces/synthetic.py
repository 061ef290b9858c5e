"""Synthetic routing traces: skewed expert popularity, tunable temporal reuse, any shape.

Each layer has its own popularity ranking (a random permutation of experts) with Zipf weights
``p(rank r) ~ 1 / (r + 1) ** skew``. A token picks its top-k experts without replacement from
the mixture ``(1 - reuse) * popularity + reuse * uniform(previous token's experts at that
layer)``, using the Gumbel-top-k trick (exact sampling without replacement, proportional to the
weights). So ``skew`` sets how concentrated routing is and ``reuse`` how often consecutive
tokens share experts. Router weights are the softmax of the chosen experts' Gumbel scores,
sorted descending (slot 0 = largest weight).

Rows come out in execution order: the prompt in prefill chunks of ``chunk`` tokens (per chunk,
layers ascending, every token of the chunk, slots), then one decode step per generated token
(layers ascending, slots).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from runtime.traces.trace import PHASE_DECODE, PHASE_PREFILL, RouteTrace, TraceHeader


@dataclass(frozen=True)
class SynthTraceSpec:
    """Shape and statistics of a synthetic trace."""

    n_layer: int = 48
    n_expert: int = 128
    top_k: int = 8
    prompt_tokens: int = 256
    decode_tokens: int = 256
    chunk: int = 512                 # prefill tokens routed per batch (llama.cpp n_ubatch)
    skew: float = 1.0                # Zipf exponent of per-layer popularity; 0 = uniform
    reuse: float = 0.3               # weight of the previous token's experts, 0..1
    seed: int = 0
    expert_bytes: tuple[int, ...] = field(default=(3 << 20,))   # one value or one per layer
    dense_bytes: tuple[int, ...] = field(default=(12 << 20,))   # one value or one per layer
    arch: str = "synthetic"
    model: str = "synthetic"

    def __post_init__(self) -> None:
        if self.n_layer < 1 or self.n_expert < 1 or not 1 <= self.top_k <= self.n_expert:
            raise ValueError("need n_layer >= 1, n_expert >= 1 and 1 <= top_k <= n_expert")
        if self.prompt_tokens < 0 or self.decode_tokens < 0 or \
                self.prompt_tokens + self.decode_tokens == 0:
            raise ValueError("need prompt_tokens, decode_tokens >= 0 and at least one token")
        if self.chunk < 1:
            raise ValueError("chunk must be >= 1")
        if self.skew < 0 or not 0 <= self.reuse <= 1:
            raise ValueError("need skew >= 0 and 0 <= reuse <= 1")
        for name in ("expert_bytes", "dense_bytes"):
            v = tuple(int(b) for b in getattr(self, name))
            if len(v) not in (1, self.n_layer) or min(v) < 0:
                raise ValueError(f"{name}: one value or one per layer, each >= 0")
            object.__setattr__(self, name, v if len(v) == self.n_layer else v * self.n_layer)
        if min(self.expert_bytes) <= 0:
            raise ValueError("expert_bytes must be > 0 (every synthetic layer is MoE)")

    def header(self) -> TraceHeader:
        return TraceHeader(model=self.model, arch=self.arch, n_layer=self.n_layer,
                           n_expert=self.n_expert, n_expert_used=self.top_k,
                           expert_bytes=self.expert_bytes, dense_bytes=self.dense_bytes)


def sample_routing(spec: SynthTraceSpec) -> tuple[np.ndarray, np.ndarray]:
    """Experts and weights for every token: two (n_tokens, n_layer, top_k) arrays, int32 and
    float32, slot order (weight descending)."""
    rng = np.random.default_rng(spec.seed)
    L, E, K = spec.n_layer, spec.n_expert, spec.top_k
    n_tokens = spec.prompt_tokens + spec.decode_tokens
    ranks = np.argsort(rng.random((L, E)), axis=1)           # (L, E) rank of each expert
    popularity = 1.0 / (ranks + 1.0) ** spec.skew
    popularity /= popularity.sum(axis=1, keepdims=True)      # (L, E), rows sum to 1
    experts = np.empty((n_tokens, L, K), dtype=np.int32)
    weights = np.empty((n_tokens, L, K), dtype=np.float32)
    layer_ix = np.arange(L)[:, None]
    prev = None                                              # (L, K) previous token's experts
    for t in range(n_tokens):
        mix = (1.0 - spec.reuse) * popularity
        if prev is not None and spec.reuse > 0:
            mix = mix.copy()
            mix[layer_ix, prev] += spec.reuse / K
        # floor: with reuse = 1 most weights are 0; keep every score finite
        scores = np.log(np.maximum(mix, 1e-30)) + rng.gumbel(size=(L, E))   # (L, E)
        top = np.argpartition(-scores, K - 1, axis=1)[:, :K]  # (L, K) unordered
        top_scores = np.take_along_axis(scores, top, axis=1)
        order = np.argsort(-top_scores, axis=1)
        top = np.take_along_axis(top, order, axis=1)
        top_scores = np.take_along_axis(top_scores, order, axis=1)
        w = np.exp(top_scores - top_scores[:, :1])
        experts[t] = top
        weights[t] = w / w.sum(axis=1, keepdims=True)
        prev = top
    return experts, weights


def synthesize(spec: SynthTraceSpec) -> RouteTrace:
    """A synthetic ``RouteTrace`` for ``spec`` (deterministic for a given seed)."""
    experts, weights = sample_routing(spec)                  # (T, L, K)
    L, K = spec.n_layer, spec.top_k
    order = []  # blocks of (token range, phase) in execution order
    for start in range(0, spec.prompt_tokens, spec.chunk):
        order.append((start, min(start + spec.chunk, spec.prompt_tokens), PHASE_PREFILL))
    for t in range(spec.prompt_tokens, spec.prompt_tokens + spec.decode_tokens):
        order.append((t, t + 1, PHASE_DECODE))
    exp_parts, w_parts, step_parts, layer_parts, phase_parts = [], [], [], [], []
    for start, stop, phase in order:
        n = stop - start
        # (L, n, K): for each layer, every token of the block, slots ascending
        exp_parts.append(experts[start:stop].transpose(1, 0, 2).reshape(-1))
        w_parts.append(weights[start:stop].transpose(1, 0, 2).reshape(-1))
        step_parts.append(np.broadcast_to(np.arange(start, stop)[None, :, None],
                                          (L, n, K)).reshape(-1))
        layer_parts.append(np.broadcast_to(np.arange(L)[:, None, None], (L, n, K)).reshape(-1))
        phase_parts.append(np.full(L * n * K, phase, dtype=np.int8))
    expert = np.concatenate(exp_parts)
    n_rows = len(expert)
    n_blocks = n_rows // K
    return RouteTrace.from_columns(
        spec.header(), source=f"synthetic(seed={spec.seed})",
        turn=np.zeros(n_rows, dtype=np.int32), phase=np.concatenate(phase_parts),
        step=np.concatenate(step_parts), layer=np.concatenate(layer_parts),
        slot=np.tile(np.arange(K, dtype=np.int16), n_blocks), expert=expert,
        weight=np.concatenate(w_parts))
