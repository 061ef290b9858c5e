/* belady (offline): the next layer-step's distinct experts, which every access must name
 * (needs_upcoming; prefetch.BeladyPrefetch). */
#include "../core_impl.h"

static int plan(rc_core *c, const rc_step_view *s, ivec *out, const double **mine) {
    (void) mine;
    if (s->up_layer < 0) return RC_OK;
    c->call++;
    for (int32_t i = 0; i < s->n_up; i++) {
        const int32_t f = s->up_layer * c->n_expert + s->up_experts[i];
        if (c->seen[f] == c->call) continue;
        c->seen[f] = c->call;
        if (ivec_push(out, f) < 0) return RC_ERR_NOMEM;
    }
    return RC_OK;
}

RC_PREFETCH_POLICY(belady, "belady", .plan = plan, .needs_upcoming = 1);
