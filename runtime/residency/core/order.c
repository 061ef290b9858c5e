/* order: the eviction orders of the residency core behind one interface (rc_order_ops,
 * core_impl.h), and the one victim loop every admission and prefetch takes.
 *
 *   rc_heap_order        an indexed binary min-heap of a pool's resident keys ordered by
 *                        (score, last seq, flat), the score the policy's pure function
 *                        (policies/evict_*.c: lru, lfu, lfu-decay, phase-weighted, belady)
 *   rc_next_visit_order  next-visit's own index (nv_victim.h): its scores move with the layer
 *                        cycle, so the heap is only the membership set and the index searches;
 *                        the index keeps its own copies of what it reads (a member's last
 *                        seq, given at push; each key's holds, counted through .hold)
 *
 * Invariant: a key is in every order of its pool iff it is resident (rc_verify checks 1, 2).
 */
#include "core_impl.h"
#include "order_heap.h"

#include <math.h>

int protected_key(const rc_core *c, int32_t f, int64_t seq0) {
    return c->last_seq[f] >= seq0 || c->lease_count[f] > 0 || c->pinned[f];
}

/* ---- the heap order ------------------------------------------------------------------- */

static int32_t heap_lowest(rc_core *c, pool *p, int32_t o, int64_t seq0) {
    heap *h = &p->h[o];
    while (h->n > 0) {
        const int32_t f = h->items[0];
        if (c->evict[o].score_is_last_seq && c->last_seq[f] >= seq0)
            return -1;                            /* the rest is newer still */
        if (!protected_key(c, f, seq0)) return f;
        heap_remove(c, p, o, f);
        if (ivec_push(&c->r_aside, f) < 0) return -1;
    }
    return -1;
}

/* v ranks strictly below f, whose score is `own` (NAN: its own) */
static int score_ranks_below(const rc_core *c, int32_t o, int32_t v, int32_t f, double own) {
    if (own != own) return key_less(c, o, v, f);
    const double sv = rc_score(c, o, v);
    if (sv != own) return sv < own;
    if (c->last_seq[v] != c->last_seq[f]) return c->last_seq[v] < c->last_seq[f];
    return v < f;
}

const rc_order_ops rc_heap_order = {
    .push = heap_push, .remove = heap_remove, .lowest = heap_lowest,
    .ranks_below = score_ranks_below,
};

/* ---- next-visit's order: the index owns the order, the set only membership -------------- */

static int nv_push(rc_core *c, pool *p, int32_t o, int32_t f) {
    heap *h = &p->h[o];
    if (h->pos[f] >= 0) return 0;
    nvv_push(c->nvv, f, c->last_seq[f]);          /* its own until f leaves (unchanged) */
    return set_push(h, f);
}

static void nv_remove(rc_core *c, pool *p, int32_t o, int32_t f) {
    heap *h = &p->h[o];
    if (h->pos[f] < 0) return;
    nvv_remove(c->nvv, f);
    set_remove(h, f);
}

static int32_t nv_lowest(rc_core *c, pool *p, int32_t o, int64_t seq0) {
    (void) o;
    return nvv_lowest(c->nvv, (int32_t) (p - c->pools), seq0);
}

static int nv_create_order(rc_core *c) {
    c->nv = nv_create(c->n_layer, c->n_expert, c->moe_layers, c->n_moe, c->pol.nv_learning_rate);
    c->nvv = c->nv == NULL ? NULL
             : nvv_create(c->nv, c->n_layer, c->n_expert, c->moe_layers, c->n_moe);
    return c->nvv == NULL ? -1 : 0;
}

static void nv_destroy(rc_core *c) {
    nv_free(c->nv);
    nvv_free(c->nvv);
    c->nv = NULL;
    c->nvv = NULL;
}

static void nv_reset(rc_core *c) { nvv_reset(c->nvv, c->pool_of_layer); }

static void nv_visit_layer(rc_core *c, int32_t layer, const int32_t *el, int32_t n,
                           int32_t phase) {
    nv_visit(c->nv, layer, el, n, phase, nvv_members(c->nvv, layer));
    nvv_stale(c->nvv, layer);                 /* its keys' z moved */
}

static void nv_hold(rc_core *c, int32_t layer, const int32_t *experts, int32_t n,
                    int32_t delta) {
    nvv_hold(c->nvv, layer, experts, n, delta);
}

static void nv_warm(rc_core *c, const double *frequency) {
    if (frequency != NULL) nv_warm_start(c->nv, frequency);
    nvv_stale_all(c->nvv);
}

/* 11 the index's own invariants, 12 its copies of the core's state */
static int nv_verify_order(const rc_core *c) {
    const int code = nvv_verify(c->nvv, c->last_seq, c->lease_count, c->pinned);
    return code == 0 ? 0 : code >= 9 ? 12 : 11;
}

const rc_order_ops rc_next_visit_order = {
    .push = nv_push, .remove = nv_remove, .lowest = nv_lowest,
    .ranks_below = score_ranks_below, .create = nv_create_order, .destroy = nv_destroy,
    .reset = nv_reset, .visit = nv_visit_layer, .hold = nv_hold, .warm_start = nv_warm,
    .verify = nv_verify_order,
};

/* ---- every order of a core ------------------------------------------------------------- */

/* (each optional hook runs through EACH_ORDER_HOOK, core_impl.h) */

int order_create(rc_core *c) {
    for (int32_t o = 0; o < c->pol.n_orders; o++)
        if (order_ops(c, o)->create != NULL && order_ops(c, o)->create(c) < 0) return -1;
    return 0;
}

void order_free(rc_core *c) { EACH_ORDER_HOOK(destroy, c); }
void order_reset(rc_core *c) { EACH_ORDER_HOOK(reset, c); }
void order_visit(rc_core *c, int32_t layer, const int32_t *el, int32_t n, int32_t phase) {
    EACH_ORDER_HOOK(visit, c, layer, el, n, phase);
}
void order_warm_start(rc_core *c, const double *frequency) {
    EACH_ORDER_HOOK(warm_start, c, frequency);
}

int order_verify(const rc_core *c) {
    for (int32_t pi = 0; pi < c->n_pool; pi++)
        for (int32_t o = 0; o < c->pol.n_orders; o++) {
            const heap *h = &c->pools[pi].h[o];
            const int sorted = order_ops(c, o) == &rc_heap_order;
            for (int32_t i = 0; i < h->n; i++) {
                if (h->pos[h->items[i]] != i) return 6;
                if (sorted && i > 0 && key_less(c, o, h->items[i], h->items[(i - 1) / 2]))
                    return 6;
            }
        }
    for (int32_t o = 0; o < c->pol.n_orders; o++)
        if (order_ops(c, o)->verify != NULL) {
            const int code = order_ops(c, o)->verify(c);
            if (code) return code;
        }
    return 0;
}

/* ---- the victim loop ------------------------------------------------------------------ */

/* protected keys set aside by lowest() go back */
static void settle(rc_core *c, pool *p, int32_t o) {
    for (int32_t i = 0; i < c->r_aside.n; i++) order_ops(c, o)->push(c, p, o, c->r_aside.v[i]);
    c->r_aside.n = 0;
}

void untake_victims(rc_core *c, pool *p, int32_t o) {
    for (int32_t i = 0; i < c->r_victims.n; i++)
        order_ops(c, o)->push(c, p, o, c->r_victims.v[i]);
}

int take_victims(rc_core *c, pool *p, int32_t o, int64_t seq0, int64_t need, int bounded,
                 int32_t f, double own) {
    const rc_order_ops *ops = order_ops(c, o);
    int64_t freed = 0;
    c->r_victims.n = 0;
    const int heap_order = ops == &rc_heap_order;   /* (called directly: see order_add) */
    while (freed < need) {
        const int32_t v = heap_order ? heap_lowest(c, p, o, seq0) : ops->lowest(c, p, o, seq0);
        if (v < 0) break;
        if (bounded && !ops->ranks_below(c, o, v, f, own)) break;  /* worth as much as f */
        if (heap_order) heap_remove(c, p, o, v);
        else ops->remove(c, p, o, v);
        if (ivec_push(&c->r_victims, v) < 0) {
            ops->push(c, p, o, v);
            break;
        }
        freed += c->bytes_flat[v];
    }
    settle(c, p, o);
    if (freed < need) {                           /* everything evictable is protected */
        untake_victims(c, p, o);
        return 0;
    }
    return 1;
}
