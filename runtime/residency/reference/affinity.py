"""``AffinityModel``: the Python reference of prefetch ``affinity``'s model
(runtime/residency/core/models/affinity.c; the rules are in affinity.h). Tests only.

Every arithmetic operation is in the order the C performs it (the same doubles).
"""
from __future__ import annotations

import math

import numpy as np

from runtime.residency.reference.neighbours import BLEND, Neighbours
from runtime.residency.types import AFFINITY_SOURCES

DECAY = 0.9
PRIOR = 8.0        # AF_PRIOR: the calibration's prior, predicted hits at factor 1
COUNT_MAX = 65535   # counts and pairs are 16-bit in the core (affinity.h)


class AffinityModel:
    def __init__(self, n_layer: int, n_expert: int, moe_layers: list[int], top_n: float,
                 min_precision: float, link_bytes: float, max_expert_bytes: float,
                 rates: tuple[float, float, float, float], n_expert_used: int = 0):
        self.link_bps, self.latency_s, self.gpu_bps, self.cpu_bps = (float(r) for r in rates)
        self.per_transfer = self.link_bps * self.latency_s
        t_max = max_expert_bytes + self.per_transfer
        self.n_expert = n_expert
        self.k = max(int(n_expert_used), 0)   # experts per token; 0 unknown
        self.moe_layers = list(moe_layers)
        self.n_moe = len(moe_layers)
        self.moe_index = [-1] * n_layer
        for i, layer in enumerate(moe_layers):
            self.moe_index[layer] = i
        lead = max(int(math.ceil(2.0 * t_max / link_bytes)), 1)
        if lead > self.n_moe - 1:
            lead = self.n_moe - 1 if self.n_moe > 1 else 1
        self.lead = lead
        self.backlog = 0.0          # link bytes queued for prefetch, not yet carried
        self.last_step_s = 0.0      # the latest step's expert compute, seconds
        self.step_ema = -1.0        # its running mean (DECAY); -1: none yet
        self.pair: dict[tuple[int, int, int], int] = {}   # (i, e, e') -> tokens
        self.count: dict[tuple[int, int], int] = {}       # (i, e) -> tokens
        self.step = 0
        self.src: dict[int, tuple[list[int], int]] = {}  # MoE index -> (distinct, step)
        self.pred: dict[int, list[int]] = {}             # target MoE index -> its plan
        self.chunk: dict[int, tuple[list[int], int]] = {}  # MoE index -> (prompt chunk, step)
        self.hits = 0.0
        self.predicted = 0.0        # decayed sum of the scored predictions' raw q
        self.keep = 1.0 - 1.0 / float(self.n_moe if self.n_moe else 1)   # per plan
        self.pred_sum: dict[int, float] = {}             # target MoE index -> its raw q sum
        self.top_n, self.min_precision = top_n, min_precision
        self.link_bytes = link_bytes
        self.nb = (Neighbours(self.n_moe, n_expert, self.k)
                   if self.k > 0 and self.n_moe and n_expert <= 32767 else None)
        self.plan_lead = lead       # how far ahead the latest plan is

    def observe(self, layer: int, experts: list[int], phase: int) -> None:
        routed = set(experts)
        idx = self.moe_index[layer]
        if idx >= 0 and idx in self.pred:
            pred = self.pred.pop(idx)
            hit = sum(1 for e in pred if e in routed)
            self.hits = self.hits * self.keep + float(hit)
            self.predicted = self.predicted * self.keep + self.pred_sum.pop(idx)
        si = idx - self.lead
        if phase == 1 and idx >= 0 and si >= 0 and si in self.src \
                and self.src[si][1] == self.step - self.lead:
            for e in self.src[si][0]:
                self._learn(si, e, routed)
        if phase == 1 and idx >= 0:
            distinct = list(dict.fromkeys(experts))
            self.src[idx] = (distinct[:AFFINITY_SOURCES], self.step)   # the strongest
            if self.nb is not None and len(experts) <= self.k:         # one token
                self.nb.decode(idx, distinct)
        k = self.k
        if phase == 0 and idx >= 0 and self.nb is not None and len(experts) % k == 0:
            self.nb.chunk(idx, list(experts))
        if phase == 0 and idx >= 0 and k > 0 and len(experts) % k == 0:   # a prompt chunk
            if si >= 0 and si in self.chunk and self.chunk[si][1] == self.step - self.lead \
                    and len(self.chunk[si][0]) == len(experts):
                src = self.chunk[si][0]
                for t in range(0, len(experts), k):     # token by token
                    routed_t = set(experts[t:t + k])
                    for e in list(dict.fromkeys(src[t:t + k]))[:AFFINITY_SOURCES]:
                        self._learn(si, e, routed_t)
            self.chunk[idx] = (list(experts), self.step)
        self.step += 1

    def _learn(self, si: int, e: int, routed) -> None:
        """Source expert e of MoE index si, for one token routed to ``routed`` at si + lead:
        count[(si, e)] grows by one (at COUNT_MAX its row and count are halved first), and
        its pairs with ``routed``."""
        c = self.count.get((si, e), 0)
        if c >= COUNT_MAX:
            for x in range(self.n_expert):
                if (si, e, x) in self.pair:
                    self.pair[(si, e, x)] >>= 1
            c >>= 1
        self.count[(si, e)] = c + 1
        for x in routed:
            self.pair[(si, e, x)] = self.pair.get((si, e, x), 0) + 1

    def warm_start(self, pair, count) -> None:
        """Add a profile's table (lead 1 only): each row's sums shifted down to 16 bits."""
        if self.n_moe < 2 or self.lead != 1:
            return
        pair, count = np.asarray(pair, dtype=np.int64), np.asarray(count, dtype=np.int64)
        for i in range(pair.shape[0]):
            for e in range(self.n_expert):
                c = self.count.get((i, e), 0) + int(count[i, e])
                row = [self.pair.get((i, e, x), 0) + int(pair[i, e, x])
                       for x in range(self.n_expert)]
                top = max([c, *row])
                sh = 0
                while (top >> sh) > COUNT_MAX:
                    sh += 1
                for x, v in enumerate(row):
                    if v or (i, e, x) in self.pair:
                        self.pair[(i, e, x)] = v >> sh
                if c or (i, e) in self.count:
                    self.count[(i, e)] = c >> sh

    def transfer_cost(self, nbytes: int) -> float:
        """A transfer's link cost in bytes (its bytes and the link latency's worth)."""
        return float(nbytes) + self.per_transfer

    def plan(self, layer: int, n_hits: int, n_misses: int, absent) -> list[tuple[int, float]]:
        """[(flat, q)] to prefetch after a decode layer-step of ``layer`` (with n_hits hits
        and n_misses misses); ``absent(flat)`` says which keys need a transfer (the only
        candidates); ``nbytes(flat)`` via self.bytes_of."""
        ne = self.n_expert
        idx = self.moe_index[layer]
        b = float(self.bytes_of(layer * ne))
        hit_s = b / self.gpu_bps
        cpu_s = b / self.cpu_bps
        miss_s = self.latency_s + b / self.link_bps + hit_s
        if cpu_s < miss_s:
            miss_s = cpu_s
        step_s = float(n_hits) * hit_s + float(n_misses) * miss_s
        self.backlog = self.backlog - self.link_bps * self.last_step_s
        if self.backlog < 0.0:
            self.backlog = 0.0
        self.last_step_s = step_s
        self.step_ema = (step_s if self.step_ema < 0.0
                         else DECAY * self.step_ema + (1.0 - DECAY) * step_s)
        if idx < 0 or idx + self.lead >= self.n_moe or idx not in self.src \
                or self.src[idx][1] != self.step - 1:
            return []
        ti = idx + self.lead
        target = self.moe_layers[ti]
        room = self.link_bps * (step_s + float(self.lead - 1) * self.step_ema)
        cal = (self.hits + PRIOR) / (self.predicted + PRIOR)
        self.plan_lead = self.lead
        if self.backlog + self.transfer_cost(self.bytes_of(target * ne)) > room:
            return self._plan_further(idx, step_s, cal, absent)   # no room at lead
        q = [0.0] * ne
        n_known = 0
        for e in self.src[idx][0]:
            cnt = self.count.get((idx, e), 0)
            if cnt == 0:
                continue
            n_known += 1
            r = 1.0 / float(cnt)
            for x in range(ne):
                q[x] = q[x] + float(self.pair.get((idx, e, x), 0)) * r
        if self.nb is not None:                    # the neighbours' vote blended in
            v, order, tot = self.nb.vote(ti)
            if order and tot > 0.0:
                a = BLEND if n_known > 0 else 1.0
                inv = 1.0 / float(n_known) if n_known > 0 else 0.0
                b = 1.0 - a
                q = [b * (x * inv) for x in q]
                a = (BLEND if n_known > 0 else 1.0) / tot
                for x in order:
                    q[x] = q[x] + a * v[x]
                n_known = 1
        if n_known == 0:
            return []
        return self._finish(ti, target, self._ranked(target, q, absent), n_known, cal, room)

    def _ranked(self, target: int, q, absent) -> list[tuple[int, float]]:
        """The top_n (expert, q) of layer ``target`` by q, then the lower id, among the keys
        that need a transfer (``q``: per expert)."""
        ne = self.n_expert
        cands = [x for x in range(ne) if absent(target * ne + x)]
        ranked = sorted(cands, key=lambda x: (-q[x], x))[:max(min(int(self.top_n), ne), 0)]
        return [(x, q[x]) for x in ranked]

    def _plan_further(self, idx: int, step_s: float, cal: float,
                      absent) -> list[tuple[int, float]]:
        """While the link is idle, the nearest MoE layer up to lead further ahead whose
        transfers cross in time and with no plan pending, from the neighbours' vote alone."""
        ne = self.n_expert
        if self.nb is None or self.backlog > 0.0:
            return []
        for d in range(1, self.lead + 1):
            ti = idx + self.lead + d
            if ti >= self.n_moe:
                return []
            if ti in self.pred:
                continue
            target = self.moe_layers[ti]
            room = self.link_bps * (step_s + float(self.lead - 1 + d) * self.step_ema)
            if self.transfer_cost(self.bytes_of(target * ne)) > room:
                continue
            v, order, tot = self.nb.vote(ti)
            if not order or not tot > 0.0:      # nothing known of it: no plan
                continue
            self.plan_lead = self.lead + d
            a = 1.0 / tot
            q = [0.0] * ne
            for x in order:
                q[x] = a * v[x]
            return self._finish(ti, target, self._ranked(target, q, absent), 1, cal, room)
        return []

    def _finish(self, ti: int, target: int, ranked, n_known: int, cal: float,
                room: float) -> list[tuple[int, float]]:
        """The plan for MoE index ti from its ranked (expert, q): those at calibrated q >=
        min_precision (scored at ti's visit); of them, what the link's room carries."""
        ne = self.n_expert
        plan = []
        raw_sum = 0.0
        for x, qv in ranked:
            raw = qv / float(n_known)
            qx = raw * cal
            if not qx > 0.0 or qx < self.min_precision:
                break
            if qx > 1.0:
                qx = 1.0
            raw_sum = raw_sum + raw
            plan.append((target * ne + x, qx))
        self.pred[ti] = [f - target * ne for f, _ in plan]
        self.pred_sum[ti] = raw_sum
        out = []
        for f, qx in plan:
            cost = self.transfer_cost(self.bytes_of(f))
            if self.backlog + cost > room:
                continue
            self.backlog = self.backlog + cost
            out.append((f, qx))
        return out

    def refund(self, nbytes: float) -> None:
        self.backlog = self.backlog - nbytes
