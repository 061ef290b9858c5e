"""``NextVisitModel``: the Python reference of eviction ``next-visit``'s model
(runtime/residency/core/models/next_visit.c; the rules are in next_visit.h). Tests only.

Every arithmetic operation is written in the order the C performs it, so both give the same
doubles (IEEE 754, no fused multiply-add: the core is built with -O2 and no -march).
"""
from __future__ import annotations

import math

RATES = (0.5, 0.125, 0.03125)
W0 = (-3.0, 2.0, 1.0, 2.0, 3.0)
STRIDE = 8
ROLL_AT = (0, 4, 35, 64)      # the rolled wait's visits after the next one (0: the next)
ROLL_LEN = (1, 7, 56)        # the visits each stands for (the last: every one from it on)


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
        self.decay = []                  # (len(ROLL_AT), 3): (1 - a_k)^n, one factor at a time
        for i, n in enumerate(ROLL_AT):
            prev = self.decay[i - 1] if i else [1.0] * len(RATES)
            row = []
            for k, a in enumerate(RATES):
                d = prev[k]
                for _ in range(n - (ROLL_AT[i - 1] if i else 0)):
                    d = d * (1.0 - a)
                row.append(d)
            self.decay.append(row)

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

    def wait(self, f: int) -> float:
        """Expected visits of ``f``'s layer after the next one until it is routed again, the
        hazard rolled forward: p at ROLL_AT's visits from the features decayed that far
        (next_visit.h)."""
        layer = f // self.n_expert
        lv, w = self.last_vis[f], self.w
        age = self.vis[layer] + 1 - lv
        o = []
        for i, n in enumerate(ROLL_AT):
            x1 = 1.0 / float(age + n) if lv > 0 else 0.0
            z = w[0] * 1.0
            z = z + w[1] * x1
            for k in range(len(RATES)):
                z = z + w[2 + k] * (self.h[k][f] * self.decay[i][k])
            o.append(math.exp(-z) if -z < 709.78 else math.inf)   # (C's exp: inf there)
        acc = 1.0 + o[-1]
        for i in range(len(ROLL_AT) - 2, 0, -1):
            q = _int_pow(o[i] / (1.0 + o[i]), ROLL_LEN[i])
            acc = (1.0 - q) * (1.0 + o[i]) + q * acc
        wait = o[0] / (1.0 + o[0]) * acc
        return wait if wait == wait else math.inf

    def expected(self, f: int) -> float:
        """Expected layer-steps until ``f``'s next use, seen from the latest visit."""
        layer = f // self.n_expert
        e = self.wait(f)
        n_moe = self.n_moe
        cur = self.moe_index[self.cur] if self.cur >= 0 else -1
        d = (self.moe_index[layer] - cur - 1) % n_moe + 1
        return float(d) + float(n_moe) * e


def _int_pow(x: float, n: int) -> float:
    """x ** n, n >= 1, by squaring in the C's order."""
    r = 1.0
    while True:
        if n & 1:
            r = r * x
        n >>= 1
        if n == 0:
            return r
        x = x * x
