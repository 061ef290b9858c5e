/* policies: the pure per-policy functions of the residency core (core_impl.h). Each reads
 * the core's statistics of a key (last access, use counts, decayed count, next use, the
 * next-visit model) and changes nothing; the mechanism (order.c, residency_core.c) consumes
 * them. The Python reference of each is one class in runtime/residency/policies/.
 */
#include "core_impl.h"

/* ---- eviction scores: the lowest (score, last seq, flat) is evicted first ---------------- */

static double score_lru(const rc_core *c, int32_t o, int32_t f) {
    (void) o;
    return (double) c->last_seq[f];
}

static double score_lfu(const rc_core *c, int32_t o, int32_t f) {
    (void) o;
    return (double) total_uses(c, f);
}

static double score_lfu_decay(const rc_core *c, int32_t o, int32_t f) {
    (void) o;
    return c->decay_log[f];
}

static double score_phase_weighted(const rc_core *c, int32_t o, int32_t f) {
    const int64_t *u = c->uses;
    const int32_t n = c->n_flat;
    return c->pol.order_p1[o] * (double) u[f]
         + c->pol.order_p2[o] * (double) (u[n + f] + u[2 * n + f]);
}

static double score_belady(const rc_core *c, int32_t o, int32_t f) {
    (void) o;
    return -(double) c->next_use[f];
}

static double score_next_visit(const rc_core *c, int32_t o, int32_t f) {
    (void) o;
    return -nv_expected(c->nv, f);
}

extern const rc_order_ops rc_heap_order, rc_next_visit_order;   /* order.c */

/* kind -> its order implementation and score (the Python registry's C kinds) */
const rc_order_kind RC_ORDER_KINDS[EV_N_KINDS] = {
    [EV_LRU] = {&rc_heap_order, score_lru, 0},
    [EV_LFU] = {&rc_heap_order, score_lfu, 0},
    [EV_LFU_DECAY] = {&rc_heap_order, score_lfu_decay, 0},
    [EV_PHASE_WEIGHTED] = {&rc_heap_order, score_phase_weighted, 0},
    [EV_BELADY] = {&rc_heap_order, score_belady, 0},
    [EV_NEXT_VISIT] = {&rc_next_visit_order, score_next_visit, 1},
};

double rc_score(const rc_core *c, int32_t o, int32_t f) {
    return RC_ORDER_KINDS[c->pol.order_kind[o]].score(c, o, f);
}

/* ---- admission: a demand miss that found its victims is admitted, or used transiently ---- */

static int admit_always(const rc_core *c, int32_t phase, int32_t f, const int32_t *victims,
                        int32_t nv) {
    (void) c; (void) phase; (void) f; (void) victims; (void) nv;
    return 1;
}

/* decode: once routed break_even times (prefill: always) */
static int admit_reuse(const rc_core *c, int32_t phase, int32_t f, const int32_t *victims,
                       int32_t nv) {
    (void) victims; (void) nv;
    if (phase == 0) return 1;
    return (double) total_uses(c, f) >= c->pol.admission_p1[phase];
}

/* unless the first victim was used within `window` accesses */
static int admit_top(const rc_core *c, int32_t phase, int32_t f, const int32_t *victims,
                     int32_t nv) {
    if (nv == 0) return 1;
    return (double) (c->last_seq[f] - c->last_seq[victims[0]]) > c->pol.admission_p1[phase];
}

/* offline: only if used again before the first victim */
static int admit_belady_bypass(const rc_core *c, int32_t phase, int32_t f,
                               const int32_t *victims, int32_t nv) {
    (void) phase;
    if (nv == 0) return 1;
    return c->next_use[f] < c->next_use[victims[0]];
}

static const rc_admit_fn RC_ADMIT[AD_N_KINDS] = {
    [AD_ALWAYS] = admit_always,
    [AD_REUSE] = admit_reuse,
    [AD_TOP] = admit_top,
    [AD_BELADY_BYPASS] = admit_belady_bypass,
};

int rc_admit(const rc_core *c, int32_t phase, int32_t f, const int32_t *victims, int32_t nv) {
    return RC_ADMIT[c->pol.admission[phase]](c, phase, f, victims, nv);
}
