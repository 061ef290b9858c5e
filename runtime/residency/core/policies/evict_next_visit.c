/* next-visit: -(expected layer-steps to the next use) from its model (next_visit.h); its
 * scores move with the layer cycle, so its order is its own index (nv_victim.h) behind the
 * order interface (below: the heap set keeps only membership, the index searches), and a
 * planner's own expected times rank against it (eviction.NextVisit). Its state: the model
 * and the index, made from its parameter block; the index keeps its own copies of what it
 * reads (a member's last seq, given at push; each key's holds, counted through .hold). */
#include "../core_impl.h"
#include "../order_heap.h"
#include "../models/next_visit.h"
#include "../models/nv_victim.h"

#include <stdlib.h>

/* its parameters (the registry's c_params, in order: c->pol.order_params[o]) */
typedef struct { double learning_rate; } nv_params;

typedef struct { nv_model *nv; nv_victim *nvv; } nv_state;

static nv_state *state_of(const rc_core *c, int32_t o) { return c->order_state[o]; }

static double score(const rc_core *c, int32_t o, int32_t f) {
    return -nv_expected(state_of(c, o)->nv, f);
}

static int push(rc_core *c, pool *p, int32_t o, int32_t f) {
    heap *h = &p->h[o];
    if (h->pos[f] >= 0) return 0;
    nvv_push(state_of(c, o)->nvv, f, c->last_seq[f]);   /* its own until f leaves (unchanged) */
    return set_push(h, f);
}

static void remove_key(rc_core *c, pool *p, int32_t o, int32_t f) {
    heap *h = &p->h[o];
    if (h->pos[f] < 0) return;
    nvv_remove(state_of(c, o)->nvv, f);
    set_remove(h, f);
}

static int32_t lowest(rc_core *c, pool *p, int32_t o, int64_t seq0) {
    return nvv_lowest(state_of(c, o)->nvv, (int32_t) (p - c->pools), seq0);
}

static void reset(rc_core *c, int32_t o) { nvv_reset(state_of(c, o)->nvv, c->pool_of_layer); }

static void visit(rc_core *c, int32_t o, int32_t layer, const int32_t *el, int32_t n,
                  int32_t phase) {
    nv_state *st = state_of(c, o);
    nv_visit(st->nv, layer, el, n, phase, nvv_members(st->nvv, layer));
    nvv_stale(st->nvv, layer);                    /* its keys' z moved */
}

static void hold(rc_core *c, int32_t o, int32_t layer, const int32_t *experts, int32_t n,
                 int32_t delta) {
    nvv_hold(state_of(c, o)->nvv, layer, experts, n, delta);
}

/* 11 the index's own invariants, 12 its copies of the core's state */
static int verify(const rc_core *c, int32_t o) {
    const int code = nvv_verify(state_of(c, o)->nvv, c->last_seq, c->lease_count, c->pinned);
    return code == 0 ? 0 : code >= 9 ? 12 : 11;
}

static const rc_order_ops next_visit_order = {
    .push = push, .remove = remove_key, .lowest = lowest, .ranks_below = order_ranks_below,
    .reset = reset, .visit = visit, .hold = hold, .verify = verify,
};

static void destroy(void *state) {
    nv_state *st = state;
    if (st == NULL) return;
    nv_free(st->nv);
    nvv_free(st->nvv);
    free(st);
}

static int create(rc_core *c, int32_t o, void **state) {
    const nv_params *p = (const nv_params *) c->pol.order_params[o];
    nv_state *st = calloc(1, sizeof *st);
    *state = st;
    if (st == NULL) return -1;
    st->nv = nv_create(c->n_layer, c->n_expert, c->moe_layers, c->n_moe, p->learning_rate);
    st->nvv = st->nv == NULL ? NULL
              : nvv_create(st->nv, c->n_layer, c->n_expert, c->moe_layers, c->n_moe);
    return st->nvv == NULL ? -1 : 0;
}

static void warm_start(void *state, const double *frequency) {
    nv_state *st = state;
    if (frequency != NULL) nv_warm_start(st->nv, frequency);
    nvv_stale_all(st->nvv);
}

RC_EVICTION_POLICY(next_visit, "next-visit", .ops = &next_visit_order, .score = score,
                   .planned_scores = 1, .create = create, .destroy = destroy,
                   .warm_start = warm_start);
