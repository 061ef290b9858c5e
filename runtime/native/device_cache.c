/* device_cache: the device cache's mechanism in C; see device_cache.h.
 *
 * Invariant: a table entry points at a slot only while the slot holds that expert's bytes, and
 * a slot is written only when no table entry points at it and no other copy runs into it. */
#include "device_cache.h"
#include "../residency/core/residency_core.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define MAX_PARTS 4

enum { J_QUEUED, J_RUNNING, J_OK, J_FAILED, J_RETIRED };

typedef struct {
    int32_t flat, slot, pool, state, cancelled, prefetch;
} job;

typedef struct { int32_t n, proj[MAX_PARTS]; int64_t offset[MAX_PARTS], stride[MAX_PARTS]; } parts;

struct dc_cache {
    rc_core *core;
    void *store;
    dc_table_set_fn table_set;
    dc_slot_set_fn slot_set;
    dc_route_fn route;
    int32_t n_used;
    int32_t n_layer, n_expert, n_flat, n_pool, wait_in_prefill;
    int32_t *pool_of_layer;
    int32_t **free_slots; int32_t *n_free;    /* per pool: a stack of free slots */
    int32_t *slot_of;                          /* (n_flat,) published slot, -1 */
    int32_t *job_of;                           /* (n_flat,) running job, -1 */
    const char *base;
    parts *layer_parts;
    job *jobs; int32_t n_jobs, cap_jobs;       /* jobs since the last time all were retired
                                                  (indices stay valid until then) */
    int32_t *queue; int32_t q_head, q_tail, q_cap;   /* job indices waiting for a worker */
    pthread_mutex_t mu;
    pthread_cond_t work, done;
    pthread_t *threads; int32_t n_threads;
    int stop;
    int64_t held;                              /* the core's lease of the last layer-step */
    int64_t copies, failures, refused, copied_bytes;
    int32_t fail_every, n_started;
    int64_t inline_bytes;                      /* experts this small copy on the caller */
    int32_t n_inline;                          /* inline copies since the last publish */
    char error[160];
};

static void *worker(void *arg);

dc_cache *dc_create(void *core, void *store, dc_table_set_fn table_set, dc_slot_set_fn slot_set,
                    dc_route_fn route, int32_t n_used,
                    int32_t n_layer, int32_t n_expert, const int32_t *pool_of_layer,
                    int32_t n_pool, const int32_t *slots, const char *file_base,
                    int32_t workers, int32_t wait_in_prefill) {
    if (core == NULL || route == NULL || n_used <= 0 || n_layer <= 0 || n_expert <= 0 ||
        n_pool < 0)
        return NULL;
    dc_cache *c = calloc(1, sizeof *c);
    if (c == NULL) return NULL;
    c->core = core; c->store = store; c->table_set = table_set; c->slot_set = slot_set;
    c->route = route; c->n_used = n_used;
    c->n_layer = n_layer; c->n_expert = n_expert; c->n_flat = n_layer * n_expert;
    c->n_pool = n_pool; c->wait_in_prefill = wait_in_prefill; c->base = file_base;
    c->pool_of_layer = malloc((size_t) n_layer * sizeof *c->pool_of_layer);
    c->free_slots = calloc((size_t) (n_pool ? n_pool : 1), sizeof *c->free_slots);
    c->n_free = calloc((size_t) (n_pool ? n_pool : 1), sizeof *c->n_free);
    c->slot_of = malloc((size_t) c->n_flat * sizeof *c->slot_of);
    c->job_of = malloc((size_t) c->n_flat * sizeof *c->job_of);
    c->layer_parts = calloc((size_t) n_layer, sizeof *c->layer_parts);
    if (!c->pool_of_layer || !c->free_slots || !c->n_free || !c->slot_of || !c->job_of ||
        !c->layer_parts) {
        dc_free(c);
        return NULL;
    }
    memcpy(c->pool_of_layer, pool_of_layer, (size_t) n_layer * sizeof *pool_of_layer);
    for (int32_t p = 0; p < n_pool; p++) {
        c->free_slots[p] = malloc((size_t) (slots[p] ? slots[p] : 1) * sizeof(int32_t));
        if (c->free_slots[p] == NULL) { dc_free(c); return NULL; }
        for (int32_t s = 0; s < slots[p]; s++) c->free_slots[p][s] = slots[p] - 1 - s;
        c->n_free[p] = slots[p];               /* the top of the stack is slot 0 */
    }
    for (int32_t f = 0; f < c->n_flat; f++) { c->slot_of[f] = -1; c->job_of[f] = -1; }
    pthread_mutex_init(&c->mu, NULL);
    pthread_cond_init(&c->work, NULL);
    pthread_cond_init(&c->done, NULL);
    c->threads = calloc((size_t) (workers > 0 ? workers : 1), sizeof *c->threads);
    if (c->threads == NULL) { dc_free(c); return NULL; }
    for (int32_t i = 0; i < (workers > 0 ? workers : 1); i++) {
        if (pthread_create(&c->threads[i], NULL, worker, c) != 0) break;
        c->n_threads++;
    }
    if (c->n_threads == 0) { dc_free(c); return NULL; }
    return c;
}

void dc_set_inline_bytes(dc_cache *c, int64_t nbytes) { c->inline_bytes = nbytes; }

int dc_set_parts(dc_cache *c, int32_t layer, int32_t n, const int32_t *proj,
                 const int64_t *offset, const int64_t *stride) {
    if (layer < 0 || layer >= c->n_layer || n < 0 || n > MAX_PARTS) return -1;
    parts *p = &c->layer_parts[layer];
    p->n = n;
    for (int32_t i = 0; i < n; i++) {
        p->proj[i] = proj[i]; p->offset[i] = offset[i]; p->stride[i] = stride[i];
    }
    return 0;
}

/* ---- jobs and workers ---------------------------------------------------------------------- */

/* the bytes of one job into its slot; 0 or the store's status (-1: an injected failure) */
static int copy_job(dc_cache *c, const job *jb, int fail) {
    int rc = fail ? -1 : 0;
    const int32_t layer = jb->flat / c->n_expert, expert = jb->flat % c->n_expert;
    const parts *p = &c->layer_parts[layer];
    for (int32_t i = 0; rc == 0 && i < p->n; i++)
        rc = c->slot_set(c->store, layer, jb->slot, p->proj[i],
                         c->base + p->offset[i] + (int64_t) expert * p->stride[i],
                         (size_t) p->stride[i]);
    return rc;
}

static void copy_failed(dc_cache *c, const job *jb, int fail) {
    snprintf(c->error, sizeof c->error, "copy of layer %d expert %d into slot %d failed (%s)",
             jb->flat / c->n_expert, jb->flat % c->n_expert, jb->slot,
             fail ? "injected" : "store status");
}

static void *worker(void *arg) {
    dc_cache *c = arg;
    pthread_mutex_lock(&c->mu);
    for (;;) {
        while (!c->stop && c->q_head == c->q_tail) pthread_cond_wait(&c->work, &c->mu);
        if (c->q_head == c->q_tail) break;     /* stopping, nothing left */
        const int32_t j = c->queue[c->q_head++ % c->q_cap];
        job jb = c->jobs[j];
        c->jobs[j].state = J_RUNNING;
        const int fail = c->fail_every > 0 && ++c->n_started % c->fail_every == 0;
        pthread_mutex_unlock(&c->mu);
        const int rc = copy_job(c, &jb, fail);  /* the bytes move without the lock */
        pthread_mutex_lock(&c->mu);
        c->jobs[j].state = rc == 0 ? J_OK : J_FAILED;
        if (rc != 0) copy_failed(c, &jb, fail);
        pthread_cond_broadcast(&c->done);
    }
    pthread_mutex_unlock(&c->mu);
    return NULL;
}

/* a new job: queued for a worker, or (``now``) copied on this thread at once */
static int push_job(dc_cache *c, job jb, int now) {
    if (c->n_jobs == c->cap_jobs) {
        int32_t cap = c->cap_jobs ? 2 * c->cap_jobs : 64;
        job *v = realloc(c->jobs, (size_t) cap * sizeof *v);
        if (v == NULL) return -1;
        c->jobs = v;
        c->cap_jobs = cap;
    }
    if (!now && c->q_tail - c->q_head >= c->q_cap) {    /* grow the ring (compact it first) */
        int32_t cap = c->q_cap ? 2 * c->q_cap : 64;
        int32_t *q = malloc((size_t) cap * sizeof *q);
        if (q == NULL) return -1;
        int32_t n = 0;
        for (int32_t i = c->q_head; i < c->q_tail; i++) q[n++] = c->queue[i % c->q_cap];
        free(c->queue);
        c->queue = q; c->q_cap = cap; c->q_head = 0; c->q_tail = n;
    }
    const int32_t j = c->n_jobs++;
    c->job_of[jb.flat] = j;
    if (now) {
        const int fail = c->fail_every > 0 && ++c->n_started % c->fail_every == 0;
        const int rc = copy_job(c, &jb, fail);
        jb.state = rc == 0 ? J_OK : J_FAILED;
        if (rc != 0) copy_failed(c, &jb, fail);
        c->jobs[j] = jb;
        c->n_inline++;
        return j;
    }
    c->jobs[j] = jb;
    c->queue[c->q_tail++ % c->q_cap] = j;
    pthread_cond_signal(&c->work);
    return j;
}

static int job_done(const job *jb) {
    return jb->state == J_OK || jb->state == J_FAILED || jb->state == J_RETIRED;
}

/* finished jobs: cancelled or failed ones free their slot, the rest enter the tables */
static void publish_locked(dc_cache *c) {
    int32_t live = 0;
    for (int32_t j = 0; j < c->n_jobs; j++) {
        job *jb = &c->jobs[j];
        if (jb->state == J_RETIRED) continue;
        if (!job_done(jb)) {
            live++;
            continue;
        }
        const int32_t layer = jb->flat / c->n_expert;
        const int ok = jb->state == J_OK;
        jb->state = J_RETIRED;
        if (c->job_of[jb->flat] == j) c->job_of[jb->flat] = -1;
        if (jb->cancelled || !ok) {
            c->free_slots[jb->pool][c->n_free[jb->pool]++] = jb->slot;
            if (!jb->cancelled) {
                c->failures++;
                rc_forget(c->core, jb->flat);     /* the expert leaves the device */
            }
            continue;
        }
        c->table_set(c->store, layer, jb->flat % c->n_expert, jb->slot);
        c->slot_of[jb->flat] = jb->slot;
        c->copies++;
        for (int32_t i = 0; i < c->layer_parts[layer].n; i++)
            c->copied_bytes += c->layer_parts[layer].stride[i];
    }
    if (live == 0) {                 /* every job retired: start the list again */
        c->n_jobs = 0;
        c->q_head = c->q_tail = 0;
    }
}

/* ---- transport ----------------------------------------------------------------------------- */

static void drop_locked(dc_cache *c, int32_t flat) {
    const int32_t slot = c->slot_of[flat];
    const int32_t layer = flat / c->n_expert;
    if (slot >= 0) {
        c->table_set(c->store, layer, flat % c->n_expert, -1);
        c->free_slots[c->pool_of_layer[layer]][c->n_free[c->pool_of_layer[layer]]++] = slot;
        c->slot_of[flat] = -1;
    }
    const int32_t j = c->job_of[flat];
    if (j >= 0) {                    /* its copy still runs: the slot frees when it is done */
        c->jobs[j].cancelled = 1;
        c->job_of[flat] = -1;
    }
}

static int submit_locked(dc_cache *c, int32_t flat, int32_t prefetch) {
    const int32_t layer = flat / c->n_expert;
    const int32_t pool = layer >= 0 && layer < c->n_layer ? c->pool_of_layer[layer] : -1;
    if (pool < 0 || c->layer_parts[layer].n == 0) {
        c->refused++;
        rc_forget(c->core, flat);
        return -1;
    }
    while (c->n_free[pool] == 0) {   /* a dropped key's copy still holds a slot: wait for it */
        int pending = 0, reclaimable = 0;
        for (int32_t j = 0; j < c->n_jobs; j++) {
            const job *jb = &c->jobs[j];
            if (jb->pool != pool || !jb->cancelled) continue;
            pending |= jb->state == J_QUEUED || jb->state == J_RUNNING;
            reclaimable |= jb->state == J_OK || jb->state == J_FAILED;
        }
        if (reclaimable) { publish_locked(c); continue; }
        if (!pending) break;
        pthread_cond_wait(&c->done, &c->mu);
    }
    if (c->n_free[pool] == 0) {
        c->refused++;
        rc_forget(c->core, flat);
        return -1;
    }
    const int32_t slot = c->free_slots[pool][--c->n_free[pool]];
    job jb = {flat, slot, pool, J_QUEUED, 0, prefetch};
    int64_t nbytes = 0;
    for (int32_t i = 0; i < c->layer_parts[layer].n; i++) nbytes += c->layer_parts[layer].stride[i];
    if (push_job(c, jb, nbytes <= c->inline_bytes) < 0) {
        c->free_slots[pool][c->n_free[pool]++] = slot;
        c->refused++;
        rc_forget(c->core, flat);
        return -1;
    }
    return 0;
}

int dc_submit(dc_cache *c, int32_t flat, int32_t prefetch) {
    if (flat < 0 || flat >= c->n_flat) return -1;
    pthread_mutex_lock(&c->mu);
    const int rc = submit_locked(c, flat, prefetch);
    pthread_mutex_unlock(&c->mu);
    return rc;
}

void dc_drop(dc_cache *c, int32_t flat) {
    if (flat < 0 || flat >= c->n_flat) return;
    pthread_mutex_lock(&c->mu);
    drop_locked(c, flat);
    pthread_mutex_unlock(&c->mu);
}

/* ---- observer ------------------------------------------------------------------------------ */

static void wait_flats(dc_cache *c, const int32_t *flats, int32_t n) {
    for (;;) {
        int busy = 0;
        for (int32_t i = 0; i < n && !busy; i++) {
            const int32_t j = c->job_of[flats[i]];
            busy = j >= 0 && !job_done(&c->jobs[j]);
        }
        if (!busy) return;
        pthread_cond_wait(&c->done, &c->mu);
    }
}

int dc_route(dc_cache *c, int32_t layer, const int32_t *experts, int32_t n, int32_t phase) {
    pthread_mutex_lock(&c->mu);
    publish_locked(c);
    rc_result r;
    const int rc = rc_step(c->core, &c->held, layer, experts, n, phase, &r);
    if (rc != 0) {
        pthread_mutex_unlock(&c->mu);
        return rc;
    }
    /* the core's result buffers live until its next call: copy what is needed */
    c->n_inline = 0;
    const int32_t n_adm = r.n_admitted, n_ev = r.n_evicted, n_pf = r.n_prefetched;
    int32_t n_pfv = 0;
    for (int32_t i = 0; i < n_pf; i++) n_pfv += r.prefetch_n_victims[i];
    int32_t *buf = malloc((size_t) (n_adm + n_ev + n_pf + n_pfv + 1) * sizeof *buf);
    if (buf == NULL) {
        pthread_mutex_unlock(&c->mu);
        return RC_ERR_NOMEM;
    }
    int32_t *adm = buf, *ev = buf + n_adm, *pf = ev + n_ev, *pfv = pf + n_pf;
    memcpy(adm, r.admitted, (size_t) n_adm * sizeof *adm);
    memcpy(ev, r.evicted, (size_t) n_ev * sizeof *ev);
    memcpy(pf, r.prefetched, (size_t) n_pf * sizeof *pf);
    memcpy(pfv, r.prefetch_victims, (size_t) n_pfv * sizeof *pfv);
    /* as the manager's transport calls go: every victim dropped, then every copy started */
    for (int32_t i = 0; i < n_ev; i++) drop_locked(c, ev[i]);
    for (int32_t i = 0; i < n_pfv; i++) drop_locked(c, pfv[i]);
    for (int32_t i = 0; i < n_adm; i++) submit_locked(c, adm[i], 0);
    for (int32_t i = 0; i < n_pf; i++) submit_locked(c, pf[i], 1);
    if (c->wait_in_prefill && phase != 1 && n_adm) {   /* the chunk uses its admissions */
        wait_flats(c, adm, n_adm);
        publish_locked(c);
    }
    free(buf);
    if (c->n_inline) publish_locked(c);    /* copied already: computed from the slots now */
    /* the id planes from the table as published now: the graph reads them next */
    const int src = c->route(c->store, layer, experts, n / c->n_used);
    pthread_mutex_unlock(&c->mu);
    return src == 0 ? 0 : -100 - src;
}

static void settle_locked(dc_cache *c) {
    for (;;) {
        int busy = 0;
        for (int32_t j = 0; j < c->n_jobs && !busy; j++)
            busy = c->jobs[j].state == J_QUEUED || c->jobs[j].state == J_RUNNING;
        if (!busy) break;
        pthread_cond_wait(&c->done, &c->mu);
    }
    publish_locked(c);
}

void dc_settle(dc_cache *c) {
    pthread_mutex_lock(&c->mu);
    settle_locked(c);
    pthread_mutex_unlock(&c->mu);
}

void dc_publish(dc_cache *c) {
    pthread_mutex_lock(&c->mu);
    publish_locked(c);
    pthread_mutex_unlock(&c->mu);
}

void dc_batch_end(dc_cache *c) {
    pthread_mutex_lock(&c->mu);
    settle_locked(c);
    rc_step_end(c->core, &c->held);
    pthread_mutex_unlock(&c->mu);
}

/* ---- queries and lifetime ------------------------------------------------------------------ */

int32_t dc_slot_of(const dc_cache *c, int32_t flat) {
    return flat >= 0 && flat < c->n_flat ? c->slot_of[flat] : -1;
}

int64_t dc_stat(const dc_cache *c, int32_t which) {
    switch (which) {
    case 0: return c->copies;
    case 1: return c->failures;
    case 2: return c->refused;
    default: return c->copied_bytes;
    }
}

const char *dc_error(const dc_cache *c) { return c->error; }
void dc_fail_every(dc_cache *c, int32_t n) { c->fail_every = n; }

void dc_free(dc_cache *c) {
    if (c == NULL) return;
    if (c->n_threads) {
        pthread_mutex_lock(&c->mu);
        c->stop = 1;
        pthread_cond_broadcast(&c->work);
        pthread_mutex_unlock(&c->mu);
        for (int32_t i = 0; i < c->n_threads; i++) pthread_join(c->threads[i], NULL);
        pthread_mutex_lock(&c->mu);
        publish_locked(c);
        rc_step_end(c->core, &c->held);
        pthread_mutex_unlock(&c->mu);
        pthread_mutex_destroy(&c->mu);
        pthread_cond_destroy(&c->work);
        pthread_cond_destroy(&c->done);
    }
    if (c->free_slots)
        for (int32_t p = 0; p < c->n_pool; p++) free(c->free_slots[p]);
    free(c->free_slots); free(c->n_free); free(c->slot_of); free(c->job_of);
    free(c->layer_parts); free(c->jobs); free(c->queue); free(c->threads);
    free(c->pool_of_layer);
    free(c);
}
