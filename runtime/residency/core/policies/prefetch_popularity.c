/* popularity: the next MoE layer's top_n (its one parameter) most routed experts, most used
 * first, then lower id; only keys used at all (prefetch.Popularity). */
#include "../core_impl.h"

#include <stdlib.h>

static int plan(rc_core *c, const rc_step_view *s, ivec *out, const double **mine) {
    (void) mine;
    const int32_t top_n = (int32_t) c->pol.prefetch_params[s->phase][0];   /* its one parameter */
    if (s->first_next >= c->n_moe || top_n <= 0) return RC_OK;
    const int32_t ne = c->n_expert;
    const int32_t l = c->moe_layers[s->first_next];
    const int32_t top = top_n < ne ? top_n : ne;
    uint8_t *taken = calloc((size_t) ne, 1);
    if (taken == NULL) return RC_ERR_NOMEM;
    for (int32_t k = 0; k < top; k++) {
        int32_t best = -1;
        int64_t best_u = -1;
        for (int32_t e = 0; e < ne; e++) {
            if (taken[e]) continue;
            const int64_t u = total_uses(c, l * ne + e);
            if (u > best_u) { best_u = u; best = e; }
        }
        if (best < 0) break;
        taken[best] = 1;
        if (best_u > 0 && ivec_push(out, l * ne + best) < 0) { free(taken); return RC_ERR_NOMEM; }
    }
    free(taken);
    return RC_OK;
}

RC_PREFETCH_POLICY(popularity, "popularity", .plan = plan);
