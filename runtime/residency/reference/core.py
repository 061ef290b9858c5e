"""``ReferenceCore``: the slow, plain Python statement of the residency core's rules.

The runtime and replay run the C core (runtime/residency/core/residency_core.c); this module
exists so tests can check it: both take the same calls and must give the same results and
the same state (tests/runtime/residency/test_core_reference.py). It favours clarity over
speed: victims are found by sorting every eligible resident key of the pool.

The rules (also the header comment of residency_core.c):
  1. Checks first (layer, expert ids, offline inputs): a rejected call changes nothing.
  2. Membership is decided at entry. Every element is touched in routing order (last access
     sequence number, use counts per phase, the decayed count, next use); the call's keys are
     protected from eviction.
  3. The call's lease is taken; the layer's prefetch pins end; prefetched keys hit now count
     as used.
  4. Misses, once per distinct key in routing order: an unresolved pool means a transient
     use; otherwise victims are the lowest (score, last seq, flat) unprotected resident keys
     of the key's pool (protected: touched by this call, leased, pinned) until the key fits;
     the admission policy may refuse (transient). The victims are evicted and the key is
     resident at once.
  5. Prefetch (never in MIXED): the phase's policy names keys; each absent one is touched,
     then brought in while victims rank strictly below it.
"""
from __future__ import annotations


import numpy as np

from runtime.residency.core import (ABSENT, COUNTERS, ERR_CHARGED, ERR_EXPERT, ERR_LAYER,
                                    ERR_NEXT_USE, ERR_NEXT_USE_LEN, ERR_POOL, ERR_STATE,
                                    ERR_UPCOMING, NEVER, RESIDENT_MAX, CoreAccess, CoreError,
                                    CorePolicy, PoolStats)
from runtime.residency.policies.factory import policy_entry
from runtime.residency.policies.prefetch import PlanStep

C = {name: i for i, name in enumerate(COUNTERS)}   # counter name -> index, the core's order


class _Pool:
    def __init__(self, capacity: int):
        self.capacity = capacity          # -1: unresolved
        self.resident_bytes = 0
        self.resident_count = 0
        self.counters = [[0] * len(C) for _ in range(3)]


class ReferenceCore:
    """Same interface as runtime.residency.core.c_core.CCore."""

    def __init__(self, n_layer: int, n_expert: int, expert_bytes, policy: CorePolicy):
        self.n_layer, self.n_expert = n_layer, n_expert
        n = n_layer * n_expert
        self.policy = policy
        self.nbytes = [int(expert_bytes[f // n_expert]) for f in range(n)]
        self.pool_layer = [0 if int(b) > 0 else -1 for b in expert_bytes]
        self.moe_layers = [i for i, b in enumerate(expert_bytes) if int(b) > 0]
        self.pools = [_Pool(-1)]
        self.state = [ABSENT] * n
        self.last = [-1] * n
        self.uses = [[0] * n for _ in range(3)]
        self.next_use = [NEVER] * n
        # each order's and phase's reference class, resolved once (as rc_create copies the
        # C descriptors into the core)
        self.evictions = [policy_entry("eviction", o[0]).reference for o in policy.orders]
        self.admissions = [policy_entry("admission", a[0]).reference for a in policy.admission]
        self.planners = [policy_entry("prefetch", p[0]).reference for p in policy.prefetch]
        # each policy's own state (its create, from its parameter block), as rc_create makes
        # it: one per order; one per distinct planner (the first phase naming it), shared
        self.order_state = [cls.create(self, params)
                            for cls, (_, params) in zip(self.evictions, policy.orders)]
        first: dict[str, object] = {}
        for cls, (name, params) in zip(self.planners, policy.prefetch):
            if name not in first:
                first[name] = cls.create(self, params)
        self.planner_state = [first[name] for name, _ in policy.prefetch]
        self.planner_models = [(self.planners[ph], first[name]) for ph, (name, _) in
                               enumerate(policy.prefetch)
                               if name not in [n for n, _ in policy.prefetch[:ph]]]
        self.keeps_history = any(p.needs_history for p in self.planners)
        self.pinned: set[int] = set()
        self.pins_by_layer: dict[int, list[int]] = {}
        self.pf_unused: set[int] = set()
        self.leases: dict[int, tuple[int, list[int]]] = {}
        self.next_lease = 1                 # the core owns every lease id (rc_lease_id)
        self.history: dict[tuple[int, int], list[int]] = {}
        self.seq = 0
        self.is_static = False
        self.pf_event_of: dict[int, int] = {}

    # -- configuration -------------------------------------------------------------------
    def set_pools(self, pool_of_layer, capacities) -> int:
        if not capacities:
            return ERR_POOL
        if any(p.resident_count for p in self.pools) or self.leases:
            return ERR_STATE
        for layer, pool in enumerate(pool_of_layer):
            moe = self.nbytes[layer * self.n_expert] > 0
            if (moe and not 0 <= pool < len(capacities)) or (not moe and pool != -1):
                return ERR_POOL
        old = self.pools
        self.pools = [_Pool(int(c)) for c in capacities]
        for p in old:                       # counters survive as a total on pool 0
            for ph in range(3):
                for k in range(len(C)):
                    self.pools[0].counters[ph][k] += p.counters[ph][k]
        self.pool_layer = list(pool_of_layer)
        return 0

    def set_capacity(self, pool: int, capacity: int) -> int:
        if not 0 <= pool < len(self.pools):
            return ERR_POOL
        p = self.pools[pool]
        if capacity >= 0 and capacity < p.resident_bytes:
            return ERR_CHARGED
        p.capacity = capacity
        return 0

    @property
    def n_pool(self) -> int:
        return len(self.pools)

    def pool_of_layer(self, layer: int) -> int:
        return self.pool_layer[layer] if 0 <= layer < self.n_layer else -1

    # -- ordering ------------------------------------------------------------------------
    def _pool(self, flat: int) -> _Pool:
        return self.pools[self.pool_layer[flat // self.n_expert]]

    def order_key(self, order: int, f: int) -> tuple:
        """(priority, last seq, flat) of ``f`` in eviction order ``order``: lowest goes first."""
        _, params = self.policy.orders[order]
        return (self.evictions[order].priority(self, params, self.order_state[order], f),
                self.last[f], f)

    def _protected(self, f: int, seq0: int) -> bool:
        leased = any(base + e == f for base, el in self.leases.values() for e in el)
        return self.last[f] >= seq0 or leased or f in self.pinned

    def _candidates(self, pool: _Pool, order: int, seq0: int) -> list[int]:
        """The pool's evictable resident keys in the order's eviction order."""
        keys = [f for f in range(len(self.state)) if self.state[f] <= RESIDENT_MAX
                and self._pool(f) is pool and not self._protected(f, seq0)]
        return self.evictions[order].victim_order(self, order, keys)

    # -- state changes -------------------------------------------------------------------
    def _make_resident(self, f: int, phase: int, prefetched: bool) -> None:
        p = self._pool(f)
        self.state[f] = phase
        p.resident_bytes += self.nbytes[f]
        p.resident_count += 1
        if prefetched:
            self.pf_unused.add(f)

    def _evict(self, f: int, phase: int) -> None:
        p = self._pool(f)
        b = self.nbytes[f]
        if self.state[f] <= RESIDENT_MAX:
            p.resident_bytes -= b
            p.resident_count -= 1
        self.state[f] = ABSENT
        t = p.counters[phase]
        t[C["evictions"]] += 1
        t[C["evicted_bytes"]] += b
        if f in self.pf_unused:
            self.pf_unused.discard(f)
            t[C["prefetch_wasted_bytes"]] += b

    # -- decisions -----------------------------------------------------------------------
    def access(self, layer: int, experts, phase: int, next_use=None, upcoming=None,
               lease_id: int = 0, release_id: int = 0):
        if release_id > 0:
            self.release(release_id)
        el = [int(e) for e in np.asarray(experts).reshape(-1).tolist()]
        if not 0 <= layer < self.n_layer or self.pool_layer[layer] < 0:
            raise CoreError(ERR_LAYER, layer)
        for e in el:
            if not 0 <= e < self.n_expert:
                raise CoreError(ERR_EXPERT, e)
        if next_use is not None:
            nul = [int(x) for x in np.asarray(next_use).reshape(-1).tolist()]
            if len(nul) != len(el):
                raise CoreError(ERR_NEXT_USE_LEN)
        else:
            nul = None
        if self.is_static:
            return self._access_static(layer, el, phase, lease_id)
        if self.policy.needs_upcoming(phase) and upcoming is None:
            raise CoreError(ERR_UPCOMING)
        if self.policy.track_next_use and nul is None:
            raise CoreError(ERR_NEXT_USE)
        base = layer * self.n_expert
        seq0 = self.seq
        self.seq += len(el)
        missed: list[int] = []
        tr = 0
        for cls, state in zip(self.evictions, self.order_state):
            if cls.visit is not None:                # (next-visit's model learns)
                cls.visit(state, layer, el, phase, [self.state[base + e] <= RESIDENT_MAX
                                                    for e in range(self.n_expert)])
        for cls, state in self.planner_models:
            if cls.observe is not None:
                cls.observe(state, layer, el, phase)
        for i, e in enumerate(el):
            f = base + e
            if self.state[f] > RESIDENT_MAX:
                if f not in missed:
                    missed.append(f)
            elif self.state[f] == 0:
                tr += 1
            self.last[f] = seq0 + i
            self.uses[phase][f] += 1
            if self.policy.track_next_use:
                self.next_use[f] = nul[i]
        for cls, state in zip(self.evictions, self.order_state):
            if cls.observe is not None:              # the policies' own counts (lfu-decay's)
                cls.observe(state, layer, el, self.n_expert, seq0)
        if lease_id > 0:
            self.leases[lease_id] = (base, list(el))
        for f in self.pins_by_layer.pop(layer, []):
            self.pinned.discard(f)
        if self.keeps_history:
            self.history[(phase, layer)] = list(el)
        pool = self.pools[self.pool_layer[layer]]
        t = pool.counters[phase]
        t[C["accesses"]] += len(el)
        used = 0
        for e in el:
            if base + e in self.pf_unused:
                self.pf_unused.discard(base + e)
                used += 1
        t[C["prefetch_used_bytes"]] += used * self.nbytes[base]
        if phase != 1:
            tr = 0
        t[C["transition_hits"]] += tr
        res = dict(admitted=[], evicted=[], transient=[], prefetched=[])
        b = self.nbytes[base]
        t[C["misses"]] += len(missed)
        t[C["demand_miss_bytes"]] += len(missed) * b
        order = self.policy.phase_order[phase]
        for f in missed:
            if pool.capacity < 0:
                res["transient"].append(f)
                continue
            free = pool.capacity - pool.resident_bytes
            victims: list[int] = []
            if free < b:
                freed = 0
                for v in self._candidates(pool, order, seq0):
                    if free + freed >= b:
                        break
                    victims.append(v)
                    freed += self.nbytes[v]
                if free + freed < b:
                    res["transient"].append(f)
                    continue
            if not self._admit(phase, f, victims):
                res["transient"].append(f)
                continue
            res["admitted"].append(f)
            res["evicted"].extend(victims)
            for v in victims:
                self._evict(v, phase)
            self._make_resident(f, phase, False)
            t[C["admissions"]] += 1
            t[C["admitted_bytes"]] += b
        if res["transient"]:
            t[C["transient_uses"]] += len(res["transient"])
            t[C["transient_bytes"]] += len(res["transient"]) * b
        if phase != 2 and self.planners[phase].plan is not None:
            self._run_prefetch(layer, phase, upcoming, seq0, res, len(el) - len(missed),
                               len(missed))
        return CoreAccess(len(el) - len(missed), len(missed), tr, len(missed) * b,
                          tuple(res["admitted"]), tuple(res["evicted"]),
                          tuple(res["transient"]), tuple(res["prefetched"]))

    def _admit(self, phase: int, f: int, victims: list[int]) -> bool:
        block = self.policy.admission[phase][1]
        return self.admissions[phase].admit(self, phase, f, victims, block[0] if block else 0.0)

    def _access_static(self, layer: int, el: list[int], phase: int, lease_id: int):
        base = layer * self.n_expert
        self.seq += len(el)
        missed = [base + e for e in dict.fromkeys(el) if self.state[base + e] > RESIDENT_MAX]
        if lease_id > 0:
            self.leases[lease_id] = (base, list(el))
        t = self.pools[self.pool_layer[layer]].counters[phase]
        m, mb = len(missed), len(missed) * self.nbytes[base]
        t[C["accesses"]] += len(el)
        t[C["misses"]] += m
        t[C["demand_miss_bytes"]] += mb
        t[C["transient_uses"]] += m
        t[C["transient_bytes"]] += mb
        return CoreAccess(len(el) - m, m, 0, mb, (), (), tuple(missed), ())

    def _run_prefetch(self, layer: int, phase: int, upcoming, seq0: int, res: dict,
                      n_hits: int, n_misses: int) -> None:
        ne = self.n_expert
        if upcoming is not None and self.policy.track_next_use:
            ul, ue, ui = upcoming
            for e, idx in zip(reversed(list(ue)), reversed(list(ui))):
                self.next_use[int(ul) * ne + int(e)] = int(idx)
        planner = self.planners[phase]
        step = PlanStep(layer, phase, self.policy.prefetch[phase][1], self.planner_state[phase],
                        upcoming, n_hits, n_misses, tuple(x for x in self.moe_layers if x > layer))
        plan, mine = planner.plan(self, step)
        if not plan:
            return
        before = len(res["prefetched"])
        self._prefetch_flats(plan, phase, seq0, res, mine)
        if hasattr(planner, "after"):
            planner.after(self, step.state, plan, [f for f, _ in res["prefetched"][before:]])

    def _prefetch_flats(self, flats, phase: int, seq0: int, res: dict, mine=None) -> None:
        order = self.policy.phase_order[phase]
        for i, f in enumerate(flats):
            if self.state[f] != ABSENT:
                continue
            pool = self._pool(f)
            if pool.capacity < 0:
                return
            b = self.nbytes[f]
            self.last[f] = self.seq
            self.seq += 1
            own = self.order_key(order, f)
            if mine is not None and self.evictions[order].planned_scores:
                own = (mine[i], self.last[f], f)
            free = pool.capacity - pool.resident_bytes
            victims: list[int] = []
            freed = 0
            for v in self._candidates(pool, order, seq0):
                if free + freed >= b or self.order_key(order, v) >= own:
                    break
                victims.append(v)
                freed += self.nbytes[v]
            if free + freed < b:
                continue
            t = pool.counters[phase]
            t[C["prefetch_issued"]] += 1
            t[C["prefetch_issued_bytes"]] += b
            self.pinned.add(f)
            self.pins_by_layer.setdefault(f // self.n_expert, []).append(f)
            for v in victims:
                self._evict(v, phase)
            self._make_resident(f, phase, True)
            res["prefetched"].append((f, tuple(victims)))

    def release(self, lease_id: int) -> None:
        self.leases.pop(lease_id, None)

    def lease_id(self) -> int:
        lease, self.next_lease = self.next_lease, self.next_lease + 1
        return lease

    # the step (step.c): one consumer's layer-step, its lease minted here, ``held`` ended
    def step(self, held: int, layer: int, experts, phase: int) -> tuple[int, CoreAccess]:
        lease = self.lease_id()
        return lease, self.access(layer, experts, phase, lease_id=lease, release_id=held)

    def step_end(self, held: int) -> None:
        if held:
            self.release(held)

    def prefetch(self, flats, phase: int):
        res = dict(admitted=[], evicted=[], transient=[], prefetched=[])
        if phase != 2 and not self.is_static:
            flats = [int(f) for f in flats]
            for f in flats:
                if not 0 <= f < len(self.state) or self.pool_layer[f // self.n_expert] < 0:
                    raise CoreError(ERR_EXPERT)
            self._prefetch_flats(flats, phase, self.seq, res)
        return CoreAccess(0, 0, 0, 0, (), (), (), tuple(res["prefetched"]))

    def replay(self, starts, layers, phases, experts, next_use, with_upcoming, miss_kind,
               pf_event=None):
        n_b = len(starts) - 1
        self.log = []                       # (batch, flat) of each prefetch, issue order
        for b in range(n_b):
            s, e = int(starts[b]), int(starts[b + 1])
            up = None
            if with_upcoming:
                up = ((int(layers[b + 1]), experts[e:int(starts[b + 2])],
                       np.arange(e, int(starts[b + 2]))) if b + 1 < n_b
                      else (int(layers[b]), experts[e:e], np.arange(e, e)))
            el = experts[s:e]
            unused = set(self.pf_unused)
            try:
                res = self.access(int(layers[b]), el, int(phases[b]),
                                  None if next_use is None else next_use[s:e], up)
            except CoreError as err:
                return err.status
            for f, _victims in res.prefetched:
                self.pf_event_of[f] = len(self.log)
                self.log.append((b, f))
            miss_kind[s:e] = 0
            admitted, transient = set(res.admitted), set(res.transient)
            base = int(layers[b]) * self.n_expert
            seen = set()
            for i, x in enumerate(el.tolist()):
                f = base + x
                if f in seen:
                    continue
                seen.add(f)
                miss_kind[s + i] = 1 if f in admitted else 2 if f in transient else 0
                if f in unused:             # its first use since it was prefetched: a hit
                    miss_kind[s + i] = 4
                    if pf_event is not None:
                        pf_event[s + i] = self.pf_event_of[f]
        return 0

    def replay_prefetches(self) -> tuple[np.ndarray, np.ndarray]:
        log = getattr(self, "log", [])
        return (np.array([b for b, _ in log], dtype=np.int64),
                np.array([f for _, f in log], dtype=np.int32))

    def warm_start(self, frequency, pair, count, history=None) -> None:
        freq = np.asarray(frequency, dtype=np.float64).reshape(-1).tolist()
        for cls, state in zip(self.evictions, self.order_state):
            if cls.warm_start is not None:
                cls.warm_start(state, freq)
        pair, count = np.asarray(pair), np.asarray(count)
        history = None if history is None else np.asarray(history)
        for cls, state in self.planner_models:
            if cls.warm_start is not None:
                cls.warm_start(state, pair, count, history)

    # -- the mechanism ---------------------------------------------------------------------
    def forget(self, f: int) -> int:
        if not 0 <= f < len(self.state) or self.state[f] > RESIDENT_MAX:
            return ERR_STATE
        p = self._pool(f)
        p.resident_bytes -= self.nbytes[f]
        p.resident_count -= 1
        self.state[f] = ABSENT
        self.pf_unused.discard(f)
        return 0

    def pin_static(self, flats) -> int:
        flats = [int(f) for f in flats]
        for f in flats:
            if (not 0 <= f < len(self.state) or self.pool_layer[f // self.n_expert] < 0
                    or self.state[f] != ABSENT):
                return ERR_STATE
        for f in flats:
            self._make_resident(f, 1, False)
        self.is_static = True
        return 0

    # -- queries -------------------------------------------------------------------------
    def states(self) -> np.ndarray:
        return np.array(self.state, dtype=np.uint8).reshape(self.n_layer, self.n_expert)

    def state(self, flat: int) -> int:
        return self.state[flat] if 0 <= flat < len(self.state) else -1

    def use_counts(self) -> np.ndarray:
        return np.array(self.uses, dtype=np.int64).reshape(3, self.n_layer, self.n_expert)

    def pool_stats(self, pool: int) -> PoolStats:
        if not 0 <= pool < len(self.pools):
            raise CoreError(ERR_POOL)
        p = self.pools[pool]
        return PoolStats(p.capacity, p.resident_bytes, p.resident_count,
                         tuple(tuple(row) for row in p.counters))

    def counters(self, pool: int, phase: int) -> tuple[int, ...]:
        return tuple(self.pools[pool].counters[phase])

    @property
    def n_leases(self) -> int:
        return len(self.leases)

    def verify(self) -> int:
        for pi, p in enumerate(self.pools):
            keys = [f for f in range(len(self.state)) if self.pool_layer[f // self.n_expert] == pi]
            res = [f for f in keys if self.state[f] <= RESIDENT_MAX]
            if p.resident_bytes != sum(self.nbytes[f] for f in res) or \
                    p.resident_count != len(res):
                return 3
            if (p.capacity < 0 and p.resident_bytes) or \
                    (p.capacity >= 0 and p.resident_bytes > p.capacity):
                return 5
        return 0
