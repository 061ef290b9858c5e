"""``AffinityModel``: the Python reference of prefetch ``affinity``'s model
(runtime/residency/core/affinity.c; the rules are in affinity.h). Tests only.

Every arithmetic operation is in the order the C performs it (the same doubles).
"""
from __future__ import annotations

DECAY = 0.9
WARMUP = 8.0


class AffinityModel:
    def __init__(self, n_layer: int, n_expert: int, moe_layers: list[int], top_n: float,
                 min_precision: float, link_bytes: float):
        self.n_expert = n_expert
        self.moe_layers = list(moe_layers)
        self.n_moe = len(moe_layers)
        self.moe_index = [-1] * n_layer
        for i, layer in enumerate(moe_layers):
            self.moe_index[layer] = i
        self.pair: dict[tuple[int, int, int], int] = {}   # (i, e, e') -> tokens
        self.count: dict[tuple[int, int], int] = {}       # (i, e) -> tokens
        self.prev: list[int] = []
        self.prev_layer = -1
        self.pred: list[int] = []
        self.pred_layer = -1
        self.hits = 0.0
        self.scored = 0.0
        self.credit = 0.0
        self.top_n, self.min_precision = top_n, min_precision
        self.link_bytes = link_bytes

    def observe(self, layer: int, experts: list[int], phase: int) -> None:
        routed = set(experts)
        if self.pred_layer == layer:
            hit = sum(1 for e in self.pred if e in routed)
            self.hits = self.hits * DECAY + float(hit)
            self.scored = self.scored * DECAY + float(len(self.pred))
        self.pred_layer = -1
        idx = self.moe_index[layer]
        if phase == 1 and self.prev_layer >= 0 and idx == self.moe_index[self.prev_layer] + 1:
            pi = idx - 1
            for e in self.prev:
                self.count[(pi, e)] = self.count.get((pi, e), 0) + 1
                for x in routed:
                    self.pair[(pi, e, x)] = self.pair.get((pi, e, x), 0) + 1
        self.prev = []
        self.prev_layer = -1
        if phase == 1:
            self.prev = list(dict.fromkeys(experts))
            self.prev_layer = layer

    def plan(self, layer: int, absent) -> list[tuple[int, float]]:
        """[(flat, q)] to prefetch after a decode layer-step of ``layer``; ``absent(flat)``
        says which keys need a transfer; ``nbytes(flat)`` via self.bytes_of."""
        ne = self.n_expert
        idx = self.moe_index[layer]
        self.credit = self.link_bytes
        if self.prev_layer != layer or idx < 0 or idx + 1 >= self.n_moe:
            return []
        q = [0.0] * ne
        n_known = 0
        for e in self.prev:
            cnt = self.count.get((idx, e), 0)
            if cnt == 0:
                continue
            n_known += 1
            for x in range(ne):
                q[x] = q[x] + float(self.pair.get((idx, e, x), 0)) / float(cnt)
        if n_known == 0:
            return []
        target = self.moe_layers[idx + 1]
        ranked = sorted(range(ne), key=lambda x: (-q[x], x))[:min(int(self.top_n), ne)]
        plan = []
        for x in ranked:
            qx = q[x] / float(n_known)
            if qx < self.min_precision:
                break
            plan.append((target * ne + x, qx))
        self.pred = [f - target * ne for f, _ in plan]
        self.pred_layer = target
        if self.scored >= WARMUP and self.hits < self.min_precision * self.scored:
            return []
        out = []
        for f, qx in plan:
            if absent(f):
                if self.credit < float(self.bytes_of(f)):
                    continue
                self.credit = self.credit - float(self.bytes_of(f))
            out.append((f, qx))
        return out

    def refund(self, nbytes: float) -> None:
        self.credit = self.credit + nbytes
