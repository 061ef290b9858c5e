/* lfu-decay: evict the key of the lowest exponentially decayed use count, kept as a log: its
 * state, updated with every layer-step's elements once they are touched (eviction.LfuDecay).
 * A use at sequence number s adds exp(rate * s) to the count, so log-count =
 * log(sum exp(rate * s)), summed in log space (log1p of the smaller over the larger). */
#include "../core_impl.h"

#include <math.h>
#include <stdlib.h>

/* its parameters (the registry's c_params, in order: c->pol.order_params[o]) */
typedef struct { double rate; } decay_params;   /* ln 2 / half_life, per access */

typedef struct { double rate; double *log; } decay_state;   /* log: (n_flat,) */

static double score(const rc_core *c, int32_t o, int32_t f) {
    return ((const decay_state *) c->order_state[o])->log[f];
}

static void observe(rc_core *c, void *state, int32_t layer, const int32_t *el, int32_t n,
                    int64_t seq0) {
    decay_state *st = state;
    const int32_t base = layer * c->n_expert;
    for (int32_t i = 0; i < n; i++) {             /* routing order: a repeat adds again */
        const int32_t f = base + el[i];
        const double a = st->log[f], x = st->rate * (double) (seq0 + i);
        const double hi = a > x ? a : x, lo = a > x ? x : a;
        st->log[f] = hi + log1p(exp(lo - hi));
    }
}

static void destroy(void *state) {
    decay_state *st = state;
    if (st != NULL) free(st->log);
    free(st);
}

static int create(rc_core *c, int32_t o, void **state) {
    decay_state *st = malloc(sizeof *st);
    *state = st;
    if (st == NULL) return -1;
    st->rate = ((const decay_params *) c->pol.order_params[o])->rate;
    st->log = malloc((size_t) c->n_flat * sizeof *st->log);
    if (st->log == NULL) return -1;
    for (int32_t f = 0; f < c->n_flat; f++) st->log[f] = -INFINITY;   /* never used */
    return 0;
}

RC_EVICTION_POLICY(lfu_decay, "lfu-decay", .ops = &rc_heap_order, .score = score,
                   .create = create, .destroy = destroy, .observe = observe);
