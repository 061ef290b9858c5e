#!/usr/bin/env python3
"""Benchmark: the residency manager's cost per decode token against a bare OrderedDict LRU.

A Qwen3-30B-A3B-shaped decode stream (48 MoE layers, 128 experts, top-8, skewed routing) runs
through ``ExpertResidencyManager.access_layer`` + ``release`` (simulated device, lru) and
through a bare ``OrderedDict`` LRU loop over the same accesses, in the same run. Prints
µs/token for both, their ratio, the hit rates (which must agree) and the command line.

    python scripts/bench_manager.py [--tokens 1000] [--capacity 0.3] [--policy lru]
"""
from __future__ import annotations

import argparse
import sys
import time
from collections import OrderedDict
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from runtime.residency.manager import ExpertResidencyManager  # noqa: E402
from runtime.residency.types import Phase  # noqa: E402


def decode_stream(tokens: int, layers: int, experts: int, top_k: int, seed: int) -> np.ndarray:
    """(tokens, layers, top_k) int32 expert ids: Zipf-like popularity per layer, distinct per
    token (Gumbel top-k)."""
    rng = np.random.default_rng(seed)
    ranks = np.argsort(rng.random((layers, experts)), axis=1)            # (L, E) permutation
    log_p = -1.1 * np.log1p(ranks.astype(np.float64))                   # Zipf s=1.1
    gumbel = rng.gumbel(size=(tokens, layers, experts))
    scores = log_p[None] + gumbel                                         # (T, L, E)
    top = np.argpartition(-scores, top_k, axis=2)[:, :, :top_k]
    order = np.take_along_axis(scores, top, axis=2).argsort(axis=2)[:, :, ::-1]
    return np.take_along_axis(top, order, axis=2).astype(np.int32)


class ManagerRun:
    """The stream through access_layer + release (the live hook's calls), lru on a sim device."""

    def __init__(self, layers: int, capacity_experts: int, policy: str):
        self.m = ExpertResidencyManager.create_simulated(
            expert_bytes=[1] * layers, n_expert=128, capacity_bytes=capacity_experts,
            policy=policy)
        self.layers = layers

    def run(self, rows: list) -> None:
        access_layer, release, decode = self.m.access_layer, self.m.release, Phase.DECODE
        for row in rows:
            for layer in range(self.layers):
                release(access_layer("sim", layer, row[layer], decode))

    def hits(self) -> int:
        self.m.verify()
        return self.m.snapshot().device("sim").phase(Phase.DECODE).hits


class BareRun:
    """The same (k,) int32 arrays through a bare OrderedDict LRU loop."""

    def __init__(self, layers: int, capacity_experts: int):
        self.cache: OrderedDict = OrderedDict()
        self.capacity = capacity_experts
        self.layers = layers
        self.n_hits = 0

    def run(self, rows: list) -> None:
        cache, capacity, hits = self.cache, self.capacity, 0
        for row in rows:
            for layer in range(self.layers):
                base = layer * 128
                for e in row[layer].tolist():
                    key = base + e
                    if key in cache:
                        cache.move_to_end(key)
                        hits += 1
                    else:
                        if len(cache) >= capacity:
                            cache.popitem(last=False)
                        cache[key] = True
        self.n_hits += hits

    def hits(self) -> int:
        return self.n_hits


def timed_pair(stream: np.ndarray, capacity: int, policy: str, chunk: int) -> tuple:
    """Both runs over the stream, alternating every ``chunk`` tokens so that a noisy shared
    machine slows both alike; returns (manager s, bare s, manager hits, bare hits)."""
    tokens, layers, _ = stream.shape
    rows = [[stream[t, layer] for layer in range(layers)] for t in range(tokens)]  # (k,) int32
    manager, bare = ManagerRun(layers, capacity, policy), BareRun(layers, capacity)
    t_manager = t_bare = 0.0
    for start in range(0, tokens, chunk):
        part = rows[start:start + chunk]
        t0 = time.perf_counter()
        manager.run(part)
        t1 = time.perf_counter()
        bare.run(part)
        t2 = time.perf_counter()
        t_manager += t1 - t0
        t_bare += t2 - t1
    return t_manager, t_bare, manager.hits(), bare.hits()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=1000)
    ap.add_argument("--capacity", type=float, default=0.3, help="share of all experts")
    ap.add_argument("--policy", default="lru")
    ap.add_argument("--repeat", type=int, default=3, help="best of N runs")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    layers, experts, top_k = 48, 128, 8
    stream = decode_stream(args.tokens, layers, experts, top_k, args.seed)
    capacity = int(args.capacity * layers * experts)
    runs = [timed_pair(stream, capacity, args.policy, chunk=20) for _ in range(args.repeat)]
    t_manager = min(r[0] for r in runs)     # best of N for each
    t_bare = min(r[1] for r in runs)
    m_best, b_best = (t_manager, runs[0][2]), (t_bare, runs[0][3])
    per_token_m = m_best[0] / args.tokens * 1e6
    per_token_b = b_best[0] / args.tokens * 1e6
    accesses = args.tokens * layers * top_k
    print(f"command: {' '.join(sys.argv)}")
    print(f"stream: {args.tokens} decode tokens x {layers} layers x top-{top_k} "
          f"= {accesses} accesses; capacity {capacity} experts ({args.capacity:.0%})")
    print(f"manager ({args.policy}): {per_token_m:8.1f} us/token  "
          f"({accesses / m_best[0] / 1e3:.0f}k accesses/s)  hit rate {m_best[1] / accesses:.4f}")
    print(f"bare OrderedDict LRU:   {per_token_b:8.1f} us/token  "
          f"({accesses / b_best[0] / 1e3:.0f}k accesses/s)  hit rate {b_best[1] / accesses:.4f}")
    print(f"ratio manager / bare: {per_token_m / per_token_b:.2f}x  (must <= 3x; target "
          f"<= 100 us/token)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
