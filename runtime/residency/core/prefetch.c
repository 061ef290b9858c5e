/* prefetch: the one loop that brings a prefetch planner's plan in. A planner (one file in
 * policies/, rc_prefetch_policy in core_impl.h) names keys in priority order from what the
 * layer-step left (rc_step_view) and changes nothing but its own model; prefetch_flats brings
 * each absent key in while victims rank strictly below it.
 */
#include "core_impl.h"
#include "order_heap.h"

#include <math.h>
#include <string.h>

/* the first phase that names ph's planner (its state is made from that phase's parameters,
 * and the later phases that name it share it: one per distinct planner) */
static int32_t first_phase_of(const rc_core *c, int32_t ph) {
    for (int32_t q = 0; q < ph; q++)
        if (c->pol.prefetch[q] == c->pol.prefetch[ph]) return q;
    return ph;
}

int prefetch_create(rc_core *c) {
    for (int32_t ph = 0; ph < 3; ph++) {
        if (c->planner[ph].create == NULL) continue;
        const int32_t first = first_phase_of(c, ph);
        if (first != ph) c->planner_state[ph] = c->planner_state[first];
        else if (c->planner[ph].create(c, ph, &c->planner_state[ph]) < 0) return -1;
    }
    return 0;
}

void prefetch_free(rc_core *c) {
    for (int32_t ph = 0; ph < 3; ph++)
        if (c->planner[ph].destroy != NULL && first_phase_of(c, ph) == ph)
            c->planner[ph].destroy(c->planner_state[ph]);
    for (int32_t ph = 0; ph < 3; ph++) c->planner_state[ph] = NULL;
}

int prefetch_observe(rc_core *c, int32_t layer, const int32_t *el, int32_t n, int32_t phase) {
    for (int32_t ph = 0; ph < 3; ph++)
        if (c->planner[ph].observe != NULL && first_phase_of(c, ph) == ph &&
            c->planner[ph].observe(c->planner_state[ph], layer, el, n, phase) < 0)
            return -1;
    return 0;
}

void prefetch_warm_start(rc_core *c, const int32_t *pair, const int32_t *count,
                         const int16_t *history, int32_t n_history, int32_t history_k) {
    for (int32_t ph = 0; ph < 3; ph++)
        if (c->planner[ph].warm_start != NULL && first_phase_of(c, ph) == ph)
            c->planner[ph].warm_start(c->planner_state[ph], pair, count, history, n_history,
                                      history_k);
}

/* bring `flats` in (priority order) where victims rank strictly below each one; mine[i]
 * (or NULL) overrides flats[i]'s own score in an order that takes planned scores
 * (next-visit: prefetch affinity's predicted expected time is in its units) */
int prefetch_flats(rc_core *c, const int32_t *flats, int32_t n, int32_t phase, int64_t seq0,
                   const double *mine) {
    const int32_t o = c->pol.phase_order[phase];
    const int planned = c->evict[o].planned_scores;
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
    const rc_prefetch_policy *planner = &c->planner[s->phase];
    int rc = planner->plan(c, s, plan, &mine);
    if (rc != RC_OK || plan->n == 0) return rc;
    const int32_t before = c->r_pf_flats.n;
    rc = prefetch_flats(c, plan->v, plan->n, s->phase, seq0, mine);
    if (planner->after != NULL) planner->after(c, c->planner_state[s->phase], plan, before);
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
