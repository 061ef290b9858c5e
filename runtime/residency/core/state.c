/* state: every change of a key's residency (core_impl.h), and a call's results. The access
 * (residency_core.c), a prefetch (prefetch.c) and the entry points (api.c: rc_forget,
 * rc_pin_static) change a key's state here and nowhere else; this file calls only the holds
 * (leases.c) and the orders (order_heap.h), so calls go one way: entry points and the step
 * above, state changes below.
 *
 * Invariant: a key is resident iff it is in every order of its pool (rc_verify checks 1, 2);
 * its pool's resident bytes and count are the sum over its resident keys (check 3).
 */
#include "core_impl.h"
#include "order_heap.h"

/* ---- state changes --------------------------------------------------------------------- */

/* f becomes resident, admitted in `phase`; a prefetched key is pinned until its layer's next
 * access (0, -1 nomem) */
int make_resident(rc_core *c, int32_t f, int32_t phase, int prefetched) {
    pool *p = pool_of(c, f);
    c->state[f] = (uint8_t) phase;
    p->resident_bytes += c->bytes_flat[f];
    p->resident_count++;
    if (prefetched) {
        c->pf_unused[f] = 1;
        c->n_pf_unused++;
        if (pin_key(c, f) < 0) return -1;
    }
    return order_add(c, f);
}

/* resident -> absent, counted in `phase`'s counters (victims are out of the orders already) */
void evict(rc_core *c, int32_t f, int32_t phase) {
    pool *p = pool_of(c, f);
    const int64_t b = c->bytes_flat[f];
    int64_t *t = p->counters[phase];
    p->resident_bytes -= b;
    p->resident_count--;
    order_discard(c, f);
    c->state[f] = ABSENT;
    t[C_EVICTIONS]++;
    t[C_EVICTED_BYTES] += b;
    if (c->pf_unused[f]) {
        c->pf_unused[f] = 0;
        c->n_pf_unused--;
        t[C_PF_WASTED_BYTES] += b;
    }
}

/* ---- results -------------------------------------------------------------------------- */

void result_reset(rc_core *c) {
    c->r_touched.n = c->r_missed.n = c->r_missed_row.n = c->r_miss_kind.n = 0;
    c->r_admitted.n = c->r_evicted.n = c->r_transient.n = 0;
    c->r_victims.n = c->r_aside.n = 0;
    c->r_pf_flats.n = c->r_pf_nv.n = c->r_pf_victims.n = c->r_pf_used_row.n = 0;
}

void result_out(rc_core *c, rc_result *out) {
    out->n_admitted = c->r_admitted.n; out->admitted = c->r_admitted.v;
    out->n_evicted = c->r_evicted.n; out->evicted = c->r_evicted.v;
    out->n_transient = c->r_transient.n; out->transient = c->r_transient.v;
    out->n_prefetched = c->r_pf_flats.n; out->prefetched = c->r_pf_flats.v;
    out->prefetch_n_victims = c->r_pf_nv.v;
    out->prefetch_victims = c->r_pf_victims.v;
}

/* ---- the entry points' state changes (api.c locks) --------------------------------------- */

/* f leaves the device (a consumer dropped it): absent, uncounted (rc_forget) */
int core_forget(rc_core *c, int32_t f) {
    if (f < 0 || f >= c->n_flat || c->state[f] > RESIDENT_MAX) return RC_ERR_STATE;
    pool *p = pool_of(c, f);
    p->resident_bytes -= c->bytes_flat[f];
    p->resident_count--;
    order_discard(c, f);
    c->state[f] = ABSENT;
    if (c->pf_unused[f]) {
        c->pf_unused[f] = 0;
        c->n_pf_unused--;
    }
    return RC_OK;
}

/* the static placement: these keys resident for good, the core static (rc_pin_static) */
int core_pin_static(rc_core *c, const int32_t *flats, int32_t n) {
    for (int32_t i = 0; i < n; i++) {
        const int32_t f = flats[i];
        if (f < 0 || f >= c->n_flat || c->pool_of_layer[f / c->n_expert] < 0 ||
            c->state[f] != ABSENT)
            return RC_ERR_STATE;
    }
    for (int32_t i = 0; i < n; i++)
        if (make_resident(c, flats[i], 1, 0) < 0) return RC_ERR_NOMEM;
    c->is_static = 1;
    return RC_OK;
}

