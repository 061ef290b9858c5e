/* affinity: at decode, its model's plan (affinity.h: a cross-layer table learned online),
 * each key ranked by its predicted expected time; what it planned but did not bring in goes
 * back to its link budget (prefetch.Affinity). Its model is the core's c->af (the core
 * feeds it every layer-step, rc_warm_start seeds it), made from the phase's p1..p3
 * (top_n, min_precision, link bytes per layer-step) and pol.affinity_rates. */
#include "../core_impl.h"

#include <stdlib.h>

static int plan(rc_core *c, const rc_step_view *s, ivec *out, const double **mine) {
    if (s->phase != 1) return RC_OK;
    const int32_t np = af_plan(c->af, s->layer, s->n - s->n_missed, s->n_missed, c->state,
                               ABSENT, c->bytes_flat, c->af_plan, c->af_q);
    for (int32_t i = 0; i < np; i++) {
        if (ivec_push(out, c->af_plan[i]) < 0) return RC_ERR_NOMEM;
        /* plan_lead layers ahead: plan_lead + n_moe (1/q - 1) */
        c->af_q[i] = -((double) c->af->plan_lead + (double) c->n_moe * (1.0 / c->af_q[i] - 1.0));
    }
    *mine = c->af_q;
    return RC_OK;
}

/* the link budget: what it planned, less what was brought in, goes back */
static void refund(rc_core *c, const ivec *planned, int32_t first_brought) {
    double spent = 0.0;                           /* every planned key is absent */
    for (int32_t i = 0; i < planned->n; i++)
        spent = spent + af_transfer_cost(c->af, c->bytes_flat[planned->v[i]]);
    for (int32_t i = first_brought; i < c->r_pf_flats.n; i++)
        spent = spent - af_transfer_cost(c->af, c->bytes_flat[c->r_pf_flats.v[i]]);
    af_refund(c->af, spent);
}

static int create(rc_core *c, int32_t ph) {
    const rc_policy *p = &c->pol;
    int64_t b_max = 0;                            /* the largest expert */
    for (int32_t l = 0; l < c->n_layer; l++)
        if (c->bytes_flat[l * c->n_expert] > b_max) b_max = c->bytes_flat[l * c->n_expert];
    c->af = af_create(c->n_layer, c->n_expert, c->moe_layers, c->n_moe, p->prefetch_p1[ph],
                      p->prefetch_p2[ph], p->prefetch_p3[ph], (double) b_max,
                      p->affinity_rates, p->n_expert_used);
    c->af_plan = malloc((size_t) c->n_expert * sizeof *c->af_plan);
    c->af_q = malloc((size_t) c->n_expert * sizeof *c->af_q);
    return c->af == NULL || c->af_plan == NULL || c->af_q == NULL ? -1 : 0;
}

static void destroy(rc_core *c) {
    af_free(c->af);
    free(c->af_plan);
    free(c->af_q);
    c->af = NULL;
    c->af_plan = NULL;
    c->af_q = NULL;
}

RC_PREFETCH_POLICY(affinity, "affinity", .plan = plan, .after = refund, .create = create,
                   .destroy = destroy);
