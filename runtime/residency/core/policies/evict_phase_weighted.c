/* phase-weighted: w_prefill * prefill uses + w_decode * (decode + mixed) uses, the weights
 * the order's p1 / p2 (eviction.PhaseWeighted). */
#include "../core_impl.h"

static double score(const rc_core *c, int32_t o, int32_t f) {
    const int64_t *u = c->uses;
    const int32_t n = c->n_flat;
    return c->pol.order_p1[o] * (double) u[f]
         + c->pol.order_p2[o] * (double) (u[n + f] + u[2 * n + f]);
}

RC_EVICTION_POLICY(phase_weighted, "phase-weighted", .ops = &rc_heap_order, .score = score);
