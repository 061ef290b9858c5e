/* order: the eviction orders of the residency core behind one interface (rc_order_ops,
 * core_impl.h), and the one victim loop every admission and prefetch takes.
 *
 *   rc_heap_order        an indexed binary min-heap of a pool's resident keys ordered by
 *                        (score, last seq, flat), the score the policy's pure function
 *                        (policies/evict_*.c: lru, lfu, lfu-decay, phase-weighted, belady)
 *   a policy's own       (next-visit's index: policies/evict_next_visit.c) behind the same
 *                        interface, its state the policy's (c->order_state[o])
 *
 * Invariant: a key is in every order of its pool iff it is resident (rc_verify checks 1, 2).
 */
#include "core_impl.h"
#include "order_heap.h"

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
int order_ranks_below(const rc_core *c, int32_t o, int32_t v, int32_t f, double own) {
    if (own != own) return key_less(c, o, v, f);
    const double sv = rc_score(c, o, v);
    if (sv != own) return sv < own;
    if (c->last_seq[v] != c->last_seq[f]) return c->last_seq[v] < c->last_seq[f];
    return v < f;
}

const rc_order_ops rc_heap_order = {
    .push = heap_push, .remove = heap_remove, .lowest = heap_lowest,
    .ranks_below = order_ranks_below,
};

/* ---- every order of a core ------------------------------------------------------------- */

/* the policies' own state (their create / destroy / observe / warm_start hooks), and the
 * order implementations' optional hooks (through EACH_ORDER_HOOK, core_impl.h) */

int order_create(rc_core *c) {
    for (int32_t o = 0; o < c->pol.n_orders; o++)
        if (c->evict[o].create != NULL && c->evict[o].create(c, o, &c->order_state[o]) < 0)
            return -1;
    return 0;
}

void order_free(rc_core *c) {
    for (int32_t o = 0; o < c->pol.n_orders; o++) {
        if (c->evict[o].destroy != NULL) c->evict[o].destroy(c->order_state[o]);
        c->order_state[o] = NULL;
    }
}

void order_reset(rc_core *c) { EACH_ORDER_HOOK(reset); }
void order_visit(rc_core *c, int32_t layer, const int32_t *el, int32_t n, int32_t phase) {
    EACH_ORDER_HOOK(visit, layer, el, n, phase);
}

void order_observe(rc_core *c, int32_t layer, const int32_t *el, int32_t n, int64_t seq0) {
    for (int32_t o = 0; o < c->pol.n_orders; o++)
        if (c->evict[o].observe != NULL) c->evict[o].observe(c, c->order_state[o], layer, el, n,
                                                             seq0);
}

void order_warm_start(rc_core *c, const double *frequency) {
    for (int32_t o = 0; o < c->pol.n_orders; o++)
        if (c->evict[o].warm_start != NULL) c->evict[o].warm_start(c->order_state[o], frequency);
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
            const int code = order_ops(c, o)->verify(c, o);
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
