/* prefetch: the residency core's prefetch planners behind one interface (rc_planner,
 * core_impl.h) and the one loop that brings a plan in. A planner names keys in priority
 * order from what the layer-step left (rc_step_view) and changes nothing but its own model;
 * prefetch_flats brings each absent key in while victims rank strictly below it.
 */
#include "core_impl.h"
#include "order_heap.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

/* prefill: the next `depth` MoE layers' experts of the previous chunk (sorted, distinct) */
static int plan_chunk(rc_core *c, const rc_step_view *s, ivec *plan, const double **mine) {
    (void) mine;
    if (s->phase != 0) return RC_OK;
    const int32_t ne = c->n_expert;
    const int32_t depth = (int32_t) c->pol.prefetch_p1[s->phase];
    for (int32_t k = s->first_next; k < c->n_moe && k < s->first_next + depth; k++) {
        const int32_t l = c->moe_layers[k];
        const ivec *prev = &c->last_experts[0 * c->n_layer + l];
        if (prev->n == 0 && prev->v == NULL) continue;
        uint8_t *mark = calloc((size_t) ne, 1);   /* np.unique: sorted distinct experts */
        if (mark == NULL) return RC_ERR_NOMEM;
        for (int32_t i = 0; i < prev->n; i++) mark[prev->v[i]] = 1;
        for (int32_t e = 0; e < ne; e++)
            if (mark[e] && ivec_push(plan, l * ne + e) < 0) { free(mark); return RC_ERR_NOMEM; }
        free(mark);
    }
    return RC_OK;
}

/* the next MoE layer's top_n most routed experts (most used first, then lower id; only keys
 * used at all) */
static int plan_popularity(rc_core *c, const rc_step_view *s, ivec *plan, const double **mine) {
    (void) mine;
    const int32_t top_n = (int32_t) c->pol.prefetch_p1[s->phase];
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
            const int32_t f = l * ne + e;
            const int64_t u = total_uses(c, f);
            if (u > best_u) { best_u = u; best = e; }
        }
        if (best < 0) break;
        taken[best] = 1;
        if (best_u > 0 && ivec_push(plan, l * ne + best) < 0) { free(taken); return RC_ERR_NOMEM; }
    }
    free(taken);
    return RC_OK;
}

/* offline: the next layer-step's distinct experts */
static int plan_belady(rc_core *c, const rc_step_view *s, ivec *plan, const double **mine) {
    (void) mine;
    if (s->up_layer < 0) return RC_OK;
    c->call++;
    for (int32_t i = 0; i < s->n_up; i++) {
        const int32_t f = s->up_layer * c->n_expert + s->up_experts[i];
        if (c->seen[f] == c->call) continue;
        c->seen[f] = c->call;
        if (ivec_push(plan, f) < 0) return RC_ERR_NOMEM;
    }
    return RC_OK;
}

/* decode: affinity's plan (affinity.h), each key ranked by its predicted expected time */
static int plan_affinity(rc_core *c, const rc_step_view *s, ivec *plan, const double **mine) {
    if (s->phase != 1) return RC_OK;
    const int32_t np = af_plan(c->af, s->layer, s->n - s->n_missed, s->n_missed, c->state,
                               ABSENT, c->bytes_flat, c->af_plan, c->af_q);
    for (int32_t i = 0; i < np; i++) {
        if (ivec_push(plan, c->af_plan[i]) < 0) return RC_ERR_NOMEM;
        /* plan_lead layers ahead: plan_lead + n_moe (1/q - 1) */
        c->af_q[i] = -((double) c->af->plan_lead + (double) c->n_moe * (1.0 / c->af_q[i] - 1.0));
    }
    *mine = c->af_q;
    return RC_OK;
}

/* affinity's link budget: what it planned, less what was brought in, goes back */
static void refund_affinity(rc_core *c, const ivec *plan, int32_t first_brought) {
    double spent = 0.0;                           /* every planned key is absent */
    for (int32_t i = 0; i < plan->n; i++)
        spent = spent + af_transfer_cost(c->af, c->bytes_flat[plan->v[i]]);
    for (int32_t i = first_brought; i < c->r_pf_flats.n; i++)
        spent = spent - af_transfer_cost(c->af, c->bytes_flat[c->r_pf_flats.v[i]]);
    af_refund(c->af, spent);
}

const rc_planner RC_PLANNERS[PF_N_KINDS] = {
    [PF_NONE] = {NULL, NULL},
    [PF_CHUNK_PLAN] = {plan_chunk, NULL},
    [PF_POPULARITY] = {plan_popularity, NULL},
    [PF_BELADY] = {plan_belady, NULL},
    [PF_AFFINITY] = {plan_affinity, refund_affinity},
};

/* bring `flats` in (priority order) where victims rank strictly below each one; mine[i]
 * (or NULL) overrides flats[i]'s own score in an order that takes planned scores
 * (next-visit: prefetch affinity's predicted expected time is in its units) */
int prefetch_flats(rc_core *c, const int32_t *flats, int32_t n, int32_t phase, int64_t seq0,
                   const double *mine) {
    const int32_t o = c->pol.phase_order[phase];
    const int planned = RC_ORDER_KINDS[c->pol.order_kind[o]].planned_scores;
    for (int32_t i = 0; i < n; i++) {
        const int32_t f = flats[i];
        if (c->state[f] != ABSENT) continue;
        pool *p = pool_of(c, f);
        if (p->capacity < 0) return 0;
        const int64_t b = c->bytes_flat[f];
        c->last_seq[f] = c->seq++;               /* a prefetch counts as a touch now */
        const int64_t free_b = p->capacity - p->resident_bytes;
        const double own = mine != NULL && planned ? mine[i] : NAN;
        if (!take_victims(c, p, o, seq0, b - free_b, 1, f, own)) continue;
        int64_t *t = p->counters[phase];
        t[C_PF_ISSUED]++;
        t[C_PF_ISSUED_BYTES] += b;
        if (c->replay_batch >= 0) {
            c->pf_event_of[f] = c->log_batch.n;
            if (lvec_push(&c->log_batch, c->replay_batch) < 0 || ivec_push(&c->log_flat, f) < 0)
                return RC_ERR_NOMEM;
        }
        for (int32_t j = 0; j < c->r_victims.n; j++)
            if (ivec_push(&c->r_pf_victims, c->r_victims.v[j]) < 0) return RC_ERR_NOMEM;
        if (ivec_push(&c->r_pf_flats, f) < 0 || ivec_push(&c->r_pf_nv, c->r_victims.n) < 0)
            return RC_ERR_NOMEM;
        for (int32_t j = 0; j < c->r_victims.n; j++) evict(c, c->r_victims.v[j], phase);
        if (make_resident(c, f, phase, 1) < 0) return RC_ERR_NOMEM;
    }
    return RC_OK;
}

/* the phase's planner after a layer-step, then its plan brought in */
int run_prefetch(rc_core *c, const rc_step_view *s, int64_t seq0) {
    const int32_t ne = c->n_expert;
    if (s->up_layer >= 0 && c->next_use != NULL) {
        /* the upcoming step's elements are their keys' next uses (first occurrence wins) */
        c->call++;
        c->r_touched.n = 0;
        for (int32_t i = 0; i < s->n_up; i++) {   /* out of the orders while their keys move */
            const int32_t f = s->up_layer * ne + s->up_experts[i];
            if (c->seen[f] == c->call) continue;
            c->seen[f] = c->call;
            if (c->state[f] <= RESIDENT_MAX) {
                order_discard(c, f);
                if (ivec_push(&c->r_touched, f) < 0) return RC_ERR_NOMEM;
            }
        }
        for (int32_t i = s->n_up - 1; i >= 0; i--)
            c->next_use[s->up_layer * ne + s->up_experts[i]] = s->up_index[i];
        for (int32_t i = 0; i < c->r_touched.n; i++)
            if (order_add(c, c->r_touched.v[i]) < 0) return RC_ERR_NOMEM;
    }
    ivec *plan = &c->r_plan;
    plan->n = 0;
    const double *mine = NULL;
    const rc_planner *planner = &RC_PLANNERS[c->pol.prefetch[s->phase]];
    int rc = planner->plan(c, s, plan, &mine);
    if (rc != RC_OK || plan->n == 0) return rc;
    const int32_t before = c->r_pf_flats.n;
    rc = prefetch_flats(c, plan->v, plan->n, s->phase, seq0, mine);
    if (planner->after != NULL) planner->after(c, plan, before);
    return rc;
}

int core_prefetch(rc_core *c, const int32_t *flats, int32_t n, int32_t phase, rc_result *out) {
    result_reset(c);
    memset(out, 0, sizeof *out);
    if (phase == 2 || c->is_static) return RC_OK;
    for (int32_t i = 0; i < n; i++)
        if (flats[i] < 0 || flats[i] >= c->n_flat || c->pool_of_layer[flats[i] / c->n_expert] < 0)
            return RC_ERR_EXPERT;
    int rc = prefetch_flats(c, flats, n, phase, c->seq, NULL);
    result_out(c, out);
    return rc;
}
