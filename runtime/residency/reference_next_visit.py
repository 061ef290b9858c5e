"""``NextVisitModel``: the Python reference of eviction ``next-visit``'s model
(runtime/residency/core/next_visit.c; the rules are in next_visit.h). Tests only.

Every arithmetic operation is written in the order the C performs it, so both give the same
doubles (IEEE 754, no fused multiply-add: the core is built with -O2 and no -march).
"""
from __future__ import annotations

import math

RATES = (0.5, 0.125, 0.03125)
W0 = (-3.0, 2.0, 1.0, 2.0, 3.0)
STRIDE = 8


class NextVisitModel:
    def __init__(self, n_layer: int, n_expert: int, moe_layers: list[int],
                 learning_rate: float):
        self.n_expert = n_expert
        self.n_moe = len(moe_layers)
        self.moe_index = [-1] * n_layer
        for i, layer in enumerate(moe_layers):
            self.moe_index[layer] = i
        n = n_layer * n_expert
        self.vis = [0] * n_layer
        self.last_vis = [0] * n
        self.h = [[0.0] * n for _ in RATES]
        self.w = list(W0)
        self.g = [0.0] * len(W0)
        self.learning_rate = learning_rate
        self.steps = 0
        self.cur = -1

    def _features(self, layer: int, f: int) -> list[float]:
        inv_age = (1.0 / float(self.vis[layer] + 1 - self.last_vis[f])
                   if self.last_vis[f] > 0 else 0.0)
        return [1.0, inv_age, self.h[0][f], self.h[1][f], self.h[2][f]]

    def logit(self, f: int) -> float:
        """z = w . x of ``f``'s features (p = 1 / (1 + exp(-z)))."""
        layer = f // self.n_expert
        x, w = self._features(layer, f), self.w
        z = w[0] * x[0]
        for j in range(1, len(x)):
            z = z + w[j] * x[j]
        return z

    def visit(self, layer: int, experts: list[int], phase: int,
              candidates: list[bool]) -> None:
        """One visit of ``layer``; ``candidates[e]``: expert e is resident (an eviction
        candidate) before the visit. Learns (decode) from the candidates only."""
        base = layer * self.n_expert
        routed = set(experts)
        if phase != 0:                   # every STRIDE-th expert, in rotation, if a candidate
            for e in range(self.steps % STRIDE, self.n_expert, STRIDE):
                if not candidates[e]:
                    continue
                x = self._features(layer, base + e)
                p = 1.0 / (1.0 + math.exp(-self.logit(base + e)))
                err = (1.0 if e in routed else 0.0) - p
                for j in range(len(x)):
                    self.g[j] = self.g[j] + err * x[j]
            self.steps += 1
            if self.steps % self.n_moe == 0:
                for j in range(len(self.w)):
                    self.w[j] = self.w[j] + self.learning_rate * self.g[j]
                    self.g[j] = 0.0
        self.vis[layer] += 1
        counts = {e: experts.count(e) for e in routed}
        top = max(counts.values(), default=0)
        for e in range(self.n_expert):
            f = base + e
            y = float(counts[e]) / float(top) if e in routed else 0.0
            for k, a in enumerate(RATES):
                self.h[k][f] = (1.0 - a) * self.h[k][f] + a * y
            if e in routed:
                self.last_vis[f] = self.vis[layer]
        self.cur = layer

    def expected(self, f: int) -> float:
        """Expected layer-steps until ``f``'s next use, seen from the latest visit."""
        layer = f // self.n_expert
        e = math.exp(-self.logit(f))
        n_moe = self.n_moe
        cur = self.moe_index[self.cur] if self.cur >= 0 else -1
        d = (self.moe_index[layer] - cur - 1) % n_moe + 1
        return float(d) + float(n_moe) * e
