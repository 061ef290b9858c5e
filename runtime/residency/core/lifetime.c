/* lifetime: a residency core's creation, its pools and their capacities (residency_core.h;
 * the rest of the core: core_impl.h). */
#include "core_impl.h"

#include <stdlib.h>
#include <string.h>

/* ---- the policies by kind (the tables policy_table.py generates) ----------------------- */

const char *rc_policy_name(int32_t role, int32_t kind) {
    if (role < RC_ROLE_EVICTION || role > RC_ROLE_PREFETCH || kind < 0 ||
        kind >= RC_N_POLICIES[role])
        return NULL;
    return role == RC_ROLE_EVICTION ? RC_EVICTION_POLICIES[kind]->name
         : role == RC_ROLE_ADMISSION ? RC_ADMISSION_POLICIES[kind]->name
         : RC_PREFETCH_POLICIES[kind]->name;
}

int32_t rc_policy_kind(int32_t role, const char *name) {
    for (int32_t k = 0; rc_policy_name(role, k) != NULL; k++)
        if (strcmp(rc_policy_name(role, k), name) == 0) return k;
    return -1;
}

static int valid_kind(int32_t role, int32_t kind) {
    return kind >= 0 && kind < RC_N_POLICIES[role];
}

/* ---- create, free -------------------------------------------------------------------------- */

rc_core *rc_create(int32_t n_layer, int32_t n_expert, const int64_t *expert_bytes,
                   const rc_policy *policy) {
    if (n_layer <= 0 || n_expert <= 0 || policy == NULL || policy->n_orders < 1 ||
        policy->n_orders > 3)
        return NULL;
    for (int32_t o = 0; o < policy->n_orders; o++)
        if (!valid_kind(RC_ROLE_EVICTION, policy->order_kind[o])) return NULL;
    for (int32_t ph = 0; ph < 3; ph++)
        if (!valid_kind(RC_ROLE_ADMISSION, policy->admission[ph]) ||
            !valid_kind(RC_ROLE_PREFETCH, policy->prefetch[ph]) ||
            policy->phase_order[ph] < 0 || policy->phase_order[ph] >= policy->n_orders)
            return NULL;
    rc_core *c = calloc(1, sizeof *c);
    if (c == NULL) return NULL;
    const int32_t n = n_layer * n_expert;
    c->n_layer = n_layer;
    c->n_expert = n_expert;
    c->n_flat = n;
    c->pol = *policy;
    int history = 0;
    for (int32_t o = 0; o < policy->n_orders; o++)
        c->evict[o] = *RC_EVICTION_POLICIES[policy->order_kind[o]];
    for (int32_t ph = 0; ph < 3; ph++) {
        c->admit[ph] = *RC_ADMISSION_POLICIES[policy->admission[ph]];
        c->planner[ph] = *RC_PREFETCH_POLICIES[policy->prefetch[ph]];
        history |= c->planner[ph].needs_history;
    }
    c->next_lease = 1;                          /* the core's lease ids: rc_lease_id */
    pthread_mutex_init(&c->mu, NULL);
    c->bytes_flat = malloc((size_t) n * sizeof *c->bytes_flat);
    c->pool_of_layer = malloc((size_t) n_layer * sizeof *c->pool_of_layer);
    c->pool_of_flat = malloc((size_t) n * sizeof *c->pool_of_flat);
    c->moe_layers = malloc((size_t) n_layer * sizeof *c->moe_layers);
    c->state = malloc((size_t) n);
    c->last_seq = malloc((size_t) n * sizeof *c->last_seq);
    c->uses = calloc((size_t) 3 * n, sizeof *c->uses);
    c->pinned = calloc((size_t) n, 1);
    c->pf_unused = calloc((size_t) n, 1);
    c->lease_count = calloc((size_t) n, sizeof *c->lease_count);
    c->seen = calloc((size_t) n, sizeof *c->seen);
    c->pf_event_of = calloc((size_t) n, sizeof *c->pf_event_of);
    c->replay_batch = -1;
    c->pins_by_layer = calloc((size_t) n_layer, sizeof *c->pins_by_layer);
    if (policy->track_next_use) c->next_use = malloc((size_t) n * sizeof *c->next_use);
    if (history) c->last_experts = calloc((size_t) 3 * n_layer, sizeof *c->last_experts);
    if (!c->bytes_flat || !c->pool_of_layer || !c->pool_of_flat || !c->moe_layers || !c->state ||
        !c->last_seq || !c->uses || !c->pinned || !c->pf_unused || !c->lease_count || !c->seen ||
        !c->pf_event_of || !c->pins_by_layer ||
        (policy->track_next_use && !c->next_use) || (history && !c->last_experts)) {
        rc_free(c);
        return NULL;
    }
    for (int32_t l = 0; l < n_layer; l++) {
        for (int32_t e = 0; e < n_expert; e++) c->bytes_flat[l * n_expert + e] = expert_bytes[l];
        c->pool_of_layer[l] = expert_bytes[l] > 0 ? 0 : -1;
        if (expert_bytes[l] > 0) c->moe_layers[c->n_moe++] = l;
    }
    memset(c->state, ABSENT, (size_t) n);
    if (order_create(c) < 0 || prefetch_create(c) < 0) {
        rc_free(c);
        return NULL;
    }
    for (int32_t i = 0; i < n; i++) {
        c->last_seq[i] = -1;
        if (c->next_use) c->next_use[i] = NEVER;
    }
    int64_t unresolved = -1;
    if (core_set_pools(c, 1, c->pool_of_layer, &unresolved) != RC_OK) {
        rc_free(c);
        return NULL;
    }
    return c;
}

static void free_pools(rc_core *c) {
    if (c->pools == NULL) return;
    for (int32_t p = 0; p < c->n_pool; p++)
        for (int o = 0; o < 3; o++) {
            free(c->pools[p].h[o].items);
            free(c->pools[p].h[o].pos);
        }
    free(c->pools);
    c->pools = NULL;
}

void rc_free(rc_core *c) {
    if (c == NULL) return;
    pthread_mutex_destroy(&c->mu);
    free_pools(c);
    order_free(c);
    prefetch_free(c);
    for (int32_t i = 0; i < c->n_leases; i++) free(c->leases[i].experts);
    if (c->pins_by_layer)
        for (int32_t l = 0; l < c->n_layer; l++) free(c->pins_by_layer[l].v);
    if (c->last_experts)
        for (int32_t i = 0; i < 3 * c->n_layer; i++) free(c->last_experts[i].v);
    ivec *iv[] = {&c->r_touched, &c->r_missed, &c->r_missed_row, &c->r_miss_kind, &c->r_admitted,
                  &c->r_evicted, &c->r_transient, &c->r_victims, &c->r_aside, &c->r_plan,
                  &c->r_pf_flats, &c->r_pf_nv, &c->r_pf_victims, &c->r_pf_used_row, &c->log_flat};
    for (size_t i = 0; i < sizeof iv / sizeof *iv; i++) free(iv[i]->v);
    free(c->log_batch.v);
    free(c->pf_event_of);
    free(c->leases); free(c->pins_by_layer); free(c->last_experts);
    free(c->bytes_flat); free(c->pool_of_layer); free(c->pool_of_flat); free(c->moe_layers);
    free(c->state); free(c->last_seq); free(c->uses); free(c->next_use);
    free(c->pinned); free(c->pf_unused); free(c->lease_count); free(c->seen);
    free(c);
}

int core_set_pools(rc_core *c, int32_t n_pool, const int32_t *pool_of_layer,
                   const int64_t *capacity) {
    if (n_pool < 1) return RC_ERR_POOL;
    if (c->pools != NULL) {
        for (int32_t p = 0; p < c->n_pool; p++)
            if (c->pools[p].resident_count) return RC_ERR_STATE;
        if (c->n_leases) return RC_ERR_STATE;
    }
    for (int32_t l = 0; l < c->n_layer; l++) {
        const int32_t want = c->bytes_flat[l * c->n_expert] > 0;
        if (want ? (pool_of_layer[l] < 0 || pool_of_layer[l] >= n_pool) : pool_of_layer[l] != -1)
            return RC_ERR_POOL;
    }
    pool *pools = calloc((size_t) n_pool, sizeof *pools);
    if (pools == NULL) return RC_ERR_NOMEM;
    for (int32_t p = 0; p < n_pool; p++) {
        pools[p].capacity = capacity[p];
        for (int o = 0; o < 3; o++) {
            pools[p].h[o].pos = malloc((size_t) c->n_flat * sizeof(int32_t));
            if (pools[p].h[o].pos == NULL) {
                for (int32_t q = 0; q <= p; q++)
                    for (int k = 0; k < 3; k++) free(pools[q].h[k].pos);
                free(pools);
                return RC_ERR_NOMEM;
            }
            for (int32_t i = 0; i < c->n_flat; i++) pools[p].h[o].pos[i] = -1;
        }
    }
    /* counters survive a re-pooling only as a total: keep them on pool 0 */
    if (c->pools != NULL)
        for (int32_t p = 0; p < c->n_pool; p++)
            for (int ph = 0; ph < 3; ph++)
                for (int k = 0; k < RC_N_COUNTERS; k++)
                    pools[0].counters[ph][k] += c->pools[p].counters[ph][k];
    free_pools(c);
    c->pools = pools;
    c->n_pool = n_pool;
    memmove(c->pool_of_layer, pool_of_layer, (size_t) c->n_layer * sizeof *pool_of_layer);
    for (int32_t f = 0; f < c->n_flat; f++) c->pool_of_flat[f] = c->pool_of_layer[f / c->n_expert];
    order_reset(c);                               /* empty orders */
    return RC_OK;
}

int core_set_capacity(rc_core *c, int32_t pool_id, int64_t capacity) {
    if (pool_id < 0 || pool_id >= c->n_pool) return RC_ERR_POOL;
    pool *p = &c->pools[pool_id];
    if (capacity >= 0 && capacity < p->resident_bytes) return RC_ERR_CHARGED;
    p->capacity = capacity;
    return RC_OK;
}

