/* api: the residency core's public entry points (residency_core.h). The locking rule lives
 * here: each takes the core's mutex for its whole call, queries included, and calls the
 * unlocked body (core_impl.h); no body calls an entry point (the mutex is not recursive).
 * rc_lease_id alone takes no mutex: its counter is atomic, so a step (step.c) can mint its id
 * before rc_access takes the mutex.
 */
#include "core_impl.h"

#include <string.h>

#define LOCKED(expr)                                                        \
    do {                                                                    \
        pthread_mutex_lock(&c->mu);                                         \
        const int64_t rc_ = (expr);                                         \
        pthread_mutex_unlock(&c->mu);                                       \
        return rc_;                                                         \
    } while (0)

int rc_set_pools(rc_core *c, int32_t n_pool, const int32_t *pool_of_layer,
                 const int64_t *capacity) {
    LOCKED(core_set_pools(c, n_pool, pool_of_layer, capacity));
}

int rc_set_capacity(rc_core *c, int32_t pool, int64_t capacity) {
    LOCKED(core_set_capacity(c, pool, capacity));
}

int64_t rc_lease_id(rc_core *c) {
    return __atomic_fetch_add(&c->next_lease, 1, __ATOMIC_RELAXED);
}

void rc_release(rc_core *c, int64_t lease_id) {
    pthread_mutex_lock(&c->mu);
    core_release(c, lease_id);
    pthread_mutex_unlock(&c->mu);
}

int rc_access(rc_core *c, int32_t layer, const int32_t *el, int32_t n, int32_t phase,
              const int64_t *next_use, int32_t up_layer, const int32_t *up_experts,
              const int64_t *up_index, int32_t n_up, int64_t lease_id, int64_t release_id,
              rc_result *out) {
    LOCKED(core_access(c, layer, el, n, phase, next_use, up_layer, up_experts, up_index, n_up,
                       lease_id, release_id, out));
}

int rc_prefetch(rc_core *c, const int32_t *flats, int32_t n, int32_t phase, rc_result *out) {
    LOCKED(core_prefetch(c, flats, n, phase, out));
}

int rc_replay(rc_core *c, int64_t n_batches, const int64_t *starts, const int32_t *layers,
              const int8_t *phases, const int32_t *experts, const int64_t *next_use,
              int32_t with_upcoming, int8_t *miss_kind, int64_t *pf_event) {
    LOCKED(core_replay(c, n_batches, starts, layers, phases, experts, next_use, with_upcoming,
                       miss_kind, pf_event));
}

int64_t rc_replay_prefetches(rc_core *c, const int64_t **batch, const int32_t **flat) {
    pthread_mutex_lock(&c->mu);
    *batch = c->log_batch.v;
    *flat = c->log_flat.v;
    const int64_t n = c->log_batch.n;
    pthread_mutex_unlock(&c->mu);
    return n;
}

int rc_warm_start(rc_core *c, const double *frequency, const int32_t *pair,
                  const int32_t *count, const int16_t *history, int32_t n_history,
                  int32_t history_k) {
    pthread_mutex_lock(&c->mu);
    prefetch_warm_start(c, pair, count, history, n_history, history_k);
    order_warm_start(c, frequency);
    pthread_mutex_unlock(&c->mu);
    return RC_OK;
}

int rc_forget(rc_core *c, int32_t flat) { LOCKED(core_forget(c, flat)); }
int rc_pin_static(rc_core *c, const int32_t *flats, int32_t n) {
    LOCKED(core_pin_static(c, flats, n));
}
int rc_verify(rc_core *c) { LOCKED(core_verify(c)); }

/* ---- queries --------------------------------------------------------------------------- */

int rc_pool_snapshot(rc_core *c, int32_t pool_id, rc_pool_stats *out) {
    pthread_mutex_lock(&c->mu);
    int rc = RC_ERR_POOL;
    if (pool_id >= 0 && pool_id < c->n_pool) {
        const pool *p = &c->pools[pool_id];
        out->capacity = p->capacity;
        out->resident_bytes = p->resident_bytes;
        out->resident_count = p->resident_count;
        memcpy(out->counters, p->counters, sizeof out->counters);
        rc = RC_OK;
    }
    pthread_mutex_unlock(&c->mu);
    return rc;
}

int32_t rc_state(rc_core *c, int32_t f) {
    LOCKED(f >= 0 && f < c->n_flat ? c->state[f] : -1);
}

void rc_copy_states(rc_core *c, uint8_t *out) {
    pthread_mutex_lock(&c->mu);
    memcpy(out, c->state, (size_t) c->n_flat);
    pthread_mutex_unlock(&c->mu);
}

void rc_copy_uses(rc_core *c, int64_t *out) {
    pthread_mutex_lock(&c->mu);
    memcpy(out, c->uses, (size_t) 3 * c->n_flat * sizeof *out);
    pthread_mutex_unlock(&c->mu);
}

int32_t rc_n_pool(rc_core *c) { LOCKED(c->n_pool); }
int32_t rc_pool_of_layer(rc_core *c, int32_t layer) {
    LOCKED(layer >= 0 && layer < c->n_layer ? c->pool_of_layer[layer] : -1);
}
int32_t rc_n_leases(rc_core *c) { LOCKED(c->n_leases); }
