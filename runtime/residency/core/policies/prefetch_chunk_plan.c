/* chunk-plan: at prefill, the next `depth` MoE layers' (its one parameter) experts of the
 * previous chunk, sorted and distinct (prefetch.ChunkPlan). The core keeps each phase's
 * latest experts per layer for it (needs_history: c->last_experts). */
#include "../core_impl.h"

#include <stdlib.h>

static int plan(rc_core *c, const rc_step_view *s, ivec *out, const double **mine) {
    (void) mine;
    if (s->phase != 0) return RC_OK;
    const int32_t ne = c->n_expert;
    const int32_t depth = (int32_t) c->pol.prefetch_params[s->phase][0];   /* its one parameter */
    for (int32_t k = s->first_next; k < c->n_moe && k < s->first_next + depth; k++) {
        const int32_t l = c->moe_layers[k];
        const ivec *prev = &c->last_experts[0 * c->n_layer + l];
        if (prev->n == 0 && prev->v == NULL) continue;
        uint8_t *mark = calloc((size_t) ne, 1);   /* np.unique: sorted distinct experts */
        if (mark == NULL) return RC_ERR_NOMEM;
        for (int32_t i = 0; i < prev->n; i++) mark[prev->v[i]] = 1;
        for (int32_t e = 0; e < ne; e++)
            if (mark[e] && ivec_push(out, l * ne + e) < 0) { free(mark); return RC_ERR_NOMEM; }
        free(mark);
    }
    return RC_OK;
}

RC_PREFETCH_POLICY(chunk_plan, "chunk-plan", .plan = plan, .needs_history = 1);
