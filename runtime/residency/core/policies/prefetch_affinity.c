/* affinity: at decode, its model's plan (affinity.h: a cross-layer table learned online),
 * each key ranked by its predicted expected time; what it planned but did not bring in goes
 * back to its link budget (prefetch.Affinity). Its state: the model (fed every layer-step
 * through observe, seeded by a profile through warm_start) and the plan's scratch, made from
 * its parameter block. */
#include "../core_impl.h"
#include "../models/affinity.h"

#include <stdlib.h>

/* its parameters (the registry's c_params, in order: c->pol.prefetch_params[phase]) */
typedef struct {
    double top_n, min_precision;
    double link_bytes;            /* what the link carries in a typical layer-step, bytes */
    double rates[4];              /* the [cost] link bytes/s, link latency s, GPU and CPU
                                     expert-compute bytes/s (affinity.h) */
} af_params;

typedef struct {
    af_model *af;
    int32_t *plan;                /* (n_expert,) scratch: its plan */
    double *q;                    /* (n_expert,) the plan's predicted probabilities */
} af_state;

static int plan(rc_core *c, const rc_step_view *s, ivec *out, const double **mine) {
    if (s->phase != 1) return RC_OK;
    af_state *st = c->planner_state[s->phase];
    const int32_t np = af_plan(st->af, s->layer, s->n - s->n_missed, s->n_missed, c->state,
                               ABSENT, c->bytes_flat, st->plan, st->q);
    for (int32_t i = 0; i < np; i++) {
        if (ivec_push(out, st->plan[i]) < 0) return RC_ERR_NOMEM;
        /* plan_lead layers ahead: plan_lead + n_moe (1/q - 1) */
        st->q[i] = -((double) st->af->plan_lead + (double) c->n_moe * (1.0 / st->q[i] - 1.0));
    }
    *mine = st->q;
    return RC_OK;
}

static void refund(rc_core *c, void *state, const ivec *planned, int32_t first_brought) {
    af_state *st = state;
    double spent = 0.0;                           /* every planned key is absent */
    for (int32_t i = 0; i < planned->n; i++)
        spent = spent + af_transfer_cost(st->af, c->bytes_flat[planned->v[i]]);
    for (int32_t i = first_brought; i < c->r_pf_flats.n; i++)
        spent = spent - af_transfer_cost(st->af, c->bytes_flat[c->r_pf_flats.v[i]]);
    af_refund(st->af, spent);
}

static int observe(void *state, int32_t layer, const int32_t *el, int32_t n, int32_t phase) {
    return af_observe(((af_state *) state)->af, layer, el, n, phase);
}

static void warm_start(void *state, const int32_t *pair, const int32_t *count,
                       const int16_t *history, int32_t n_history, int32_t history_k) {
    af_model *af = ((af_state *) state)->af;
    if (pair != NULL && count != NULL) af_warm_start(af, pair, count);
    if (af->nb != NULL && history != NULL && history_k > 0)
        nb_warm_start(af->nb, history, n_history, history_k);
}

static void destroy(void *state) {
    af_state *st = state;
    if (st == NULL) return;
    af_free(st->af);
    free(st->plan);
    free(st->q);
    free(st);
}

static int create(rc_core *c, int32_t ph, void **state) {
    const af_params *p = (const af_params *) c->pol.prefetch_params[ph];
    af_state *st = calloc(1, sizeof *st);
    *state = st;
    if (st == NULL) return -1;
    int64_t b_max = 0;                            /* the largest expert */
    for (int32_t l = 0; l < c->n_layer; l++)
        if (c->bytes_flat[l * c->n_expert] > b_max) b_max = c->bytes_flat[l * c->n_expert];
    st->af = af_create(c->n_layer, c->n_expert, c->moe_layers, c->n_moe, p->top_n,
                       p->min_precision, p->link_bytes, (double) b_max, p->rates,
                       c->pol.n_expert_used);
    st->plan = malloc((size_t) c->n_expert * sizeof *st->plan);
    st->q = malloc((size_t) c->n_expert * sizeof *st->q);
    return st->af == NULL || st->plan == NULL || st->q == NULL ? -1 : 0;
}

RC_PREFETCH_POLICY(affinity, "affinity", .plan = plan, .after = refund, .create = create,
                   .destroy = destroy, .observe = observe, .warm_start = warm_start);
