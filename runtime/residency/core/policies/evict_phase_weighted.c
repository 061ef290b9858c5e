/* phase-weighted: w_prefill * prefill uses + w_decode * (decode + mixed) uses, the weights
 * its parameters (eviction.PhaseWeighted). */
#include "../core_impl.h"

/* its parameters (the registry's c_params, in order: c->pol.order_params[o]) */
typedef struct { double w_prefill, w_decode; } weights;

static double score(const rc_core *c, int32_t o, int32_t f) {
    const int64_t *u = c->uses;
    const int32_t n = c->n_flat;
    const weights *w = (const weights *) c->pol.order_params[o];
    return w->w_prefill * (double) u[f] + w->w_decode * (double) (u[n + f] + u[2 * n + f]);
}

RC_EVICTION_POLICY(phase_weighted, "phase-weighted", .ops = &rc_heap_order, .score = score);
