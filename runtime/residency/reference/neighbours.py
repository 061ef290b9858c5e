"""``Neighbours``: the Python reference of prefetch ``affinity``'s token-neighbour vote
(runtime/residency/core/models/neighbours.c; the rules are in neighbours.h). Tests only.

Where the C keeps bitsets and a top list updated as sims grow, this keeps every token's
routing and ranks by sorting; every floating-point operation is the C's, in its order (the
same doubles).
"""
from __future__ import annotations

HISTORY = 128    # NB_HISTORY: tokens kept
K = 2            # NB_K: tokens that vote
K_MAX = 64       # NB_K_MAX: a prompt token's distinct experts kept
WALK = 2         # NB_WALK: the scored token's experts matched, per layer
COMMON = 16      # NB_COMMON: an expert held by more history tokens at a layer is not matched
DECAY = 0.75     # NB_DECAY
BLEND = 0.5      # NB_BLEND: the vote's share of q


class Neighbours:
    def __init__(self, n_moe: int, n_expert: int, k: int):
        self.n_moe, self.n_expert, self.k = n_moe, n_expert, k
        self.n_tok = 0
        self.cur = -1                 # the decode token being scored
        self.last_idx = n_moe         # the MoE index of its latest layer-step
        self.p_base, self.p_n, self.p_idx = 0, -1, n_moe
        self.rec: dict[int, dict[int, list[int]]] = {}   # token -> MoE index -> experts
        self.sim: dict[int, float] = {}                 # token -> scaled sim, for cur
        up = 1.0 / DECAY
        self.inc = [1.0]
        for _ in range(1, n_moe):
            self.inc.append(self.inc[-1] * up)

    def _new_token(self) -> int:
        t = self.n_tok
        self.n_tok += 1
        self.rec.pop(t - HISTORY, None)             # leaves the window
        self.rec[t] = {}
        return t

    def decode(self, idx: int, d: list[int]) -> None:
        """A decode layer-step of MoE index ``idx``: one token's distinct experts ``d``."""
        if idx <= self.last_idx:
            self.cur = self._new_token()
            self.sim = {}
        self.last_idx = idx
        self.p_idx = self.n_moe
        inc = self.inc[idx]
        for e in d[:WALK]:
            holders = [t for t, r in self.rec.items() if e in r.get(idx, ())]
            if len(holders) > COMMON:
                continue
            for t in holders:
                self.sim[t] = self.sim.get(t, 0.0) + inc
        self.rec[self.cur][idx] = list(d[:self.k])

    def chunk(self, idx: int, el: list[int]) -> None:
        """A prompt chunk at MoE index ``idx``: k experts per token, token-major."""
        k = self.k
        nt = len(el) // k
        if idx <= self.p_idx or len(el) != self.p_n:
            self.p_base = self.n_tok
            for _ in range(nt):
                self._new_token()
            self.p_n = len(el)
        self.p_idx = idx
        self.last_idx = self.n_moe
        self.cur = -1
        for t in range(nt):
            tok = self.p_base + t
            if tok < self.n_tok - HISTORY:
                continue
            d = list(dict.fromkeys(el[t * k:(t + 1) * k]))[:K_MAX]
            self.rec[tok][idx] = d[:k]

    def warm_start(self, history: list[list[list[int]]]) -> None:
        """A profile's decode tokens join the history, oldest first (per token, per MoE
        layer, its distinct experts, -1 pad)."""
        for tok in history:
            t = self._new_token()
            for i, row in enumerate(tok):
                d = []
                for e in row:
                    if e < 0 or len(d) == K_MAX:
                        break
                    d.append(int(e))
                self.rec[t][i] = d[:self.k]
        self.cur = -1
        self.last_idx = self.n_moe
        self.p_idx = self.n_moe

    def vote(self, ti: int) -> tuple[dict[int, float], list[int], float]:
        """(the voters' sim summed per expert at MoE index ``ti``, the experts in the order
        first voted for, the voters' sim summed): the NB_K tokens of highest (sim, token)."""
        v: dict[int, float] = {}
        order: list[int] = []
        tot = 0.0
        if self.cur < 0:
            return v, order, tot
        ranked = sorted(((s, t) for t, s in self.sim.items() if s > 0.0), reverse=True)
        for s, t in ranked[:K]:
            ex = self.rec[t].get(ti, [])
            if not ex:
                continue
            for e in ex:
                if e not in v:
                    order.append(e)
                v[e] = v.get(e, 0.0) + s
            tot = tot + s
        return v, order, tot
