/* residency_core: see residency_core.h. The rules, in the order access() applies them:
 *
 *  1. Checks first (layer, expert ids, offline inputs): a rejected call changes nothing.
 *  2. Membership is decided at entry: an element whose key is resident is a hit. Every element
 *     is touched in routing order (last access sequence number, use counts, decayed counts,
 *     next use); the call's keys are protected from eviction (touched at or after seq0).
 *  3. The lease of the call is taken; the layer's prefetch pins end; prefetched keys hit now
 *     count as used.
 *  4. Misses, once per distinct key in routing order: a key in flight joins its ticket; an
 *     unresolved pool or an evicting key is used transiently; otherwise victims are taken in
 *     the phase's eviction order (lowest (score, last seq, flat) first) from the key's pool,
 *     skipping protected keys (this call's, other leases', prefetch pins) until the key fits;
 *     the admission policy may still refuse (transient). Inline: victims are evicted and the
 *     key becomes resident at once; else a ticket reserves them.
 *  5. Prefetch (not in MIXED): the phase's prefetch policy names keys; each absent one is
 *     touched, then brought in while victims rank strictly below it.
 */
#include "residency_core.h"
#include "next_visit.h"
#include "nv_victim.h"
#include "affinity.h"
#include "grow.h"

#include <math.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#define RESIDENT_MAX 2
#define ABSENT 8
#define PENDING 9
#define EVICTING 10
#define NEVER (((int64_t) 1) << 62)

enum { EV_LRU, EV_LFU, EV_LFU_DECAY, EV_PHASE_WEIGHTED, EV_BELADY, EV_NEXT_VISIT };
enum { AD_ALWAYS, AD_REUSE, AD_TOP, AD_BELADY_BYPASS };
enum { PF_NONE, PF_CHUNK_PLAN, PF_POPULARITY, PF_BELADY, PF_AFFINITY };
enum { C_ACCESSES, C_MISSES, C_DEMAND_BYTES, C_ADMISSIONS, C_ADMITTED_BYTES, C_TRANSIENT,
       C_TRANSIENT_BYTES, C_EVICTIONS, C_EVICTED_BYTES, C_PF_ISSUED, C_PF_ISSUED_BYTES,
       C_PF_USED_BYTES, C_PF_WASTED_BYTES, C_TRANSITION_HITS };

typedef struct { int32_t *v; int32_t n; int64_t cap; } ivec;
typedef struct { int64_t *v; int32_t n; int64_t cap; } lvec;

static int ivec_push(ivec *a, int32_t x) {
    if (array_grow((void **) &a->v, &a->cap, (int64_t) a->n + 1, sizeof *a->v)) return -1;
    a->v[a->n++] = x;
    return 0;
}

static int lvec_push(lvec *a, int64_t x) {
    if (array_grow((void **) &a->v, &a->cap, (int64_t) a->n + 1, sizeof *a->v)) return -1;
    a->v[a->n++] = x;
    return 0;
}

/* an indexed binary min-heap of flat keys ordered by the order's (score, last seq, flat) */
typedef struct { int32_t *items; int32_t n; int64_t cap; int32_t *pos; } heap;

typedef struct {
    int64_t capacity, resident_bytes, pending_bytes, resident_count;
    int32_t pending_tickets;
    heap h[3];
    int64_t counters[3][RC_N_COUNTERS];
} pool;

typedef struct { int64_t id; int32_t base, n; int32_t *experts; } lease;

typedef struct {
    int64_t id, bytes, claim;
    int32_t flat, n_victims, phase, prefetch;
    int32_t *victims;
    uint8_t *before;
} ticket;

struct rc_core {
    pthread_mutex_t mu;           /* every public entry point holds it: the routing hook calls
                                     from the graph thread while Python reads counters */
    int32_t n_layer, n_expert, n_flat, n_pool, is_static;
    int64_t *bytes_flat;          /* (n_flat,) bytes of one expert */
    int32_t *pool_of_layer;       /* (n_layer,) -1: dense */
    int32_t *pool_of_flat;        /* (n_flat,) the same per key */
    int32_t *moe_layers; int32_t n_moe;
    pool *pools;
    uint8_t *state;               /* (n_flat,) 0..2 resident (admitting phase), ABSENT, ... */
    int64_t *last_seq;            /* (n_flat,) */
    int64_t *uses;                /* (3, n_flat) routed count per phase */
    double *decay_log;            /* (n_flat,) or NULL */
    int64_t *next_use;            /* (n_flat,) or NULL */
    nv_model *nv;                 /* eviction next-visit's model, or NULL */
    nv_victim *nvv;               /* next-visit's victim search, or NULL */
    af_model *af;                 /* prefetch affinity's model, or NULL */
    int32_t *af_plan;             /* (n_expert,) scratch: its plan */
    double *af_q;                 /* (n_expert,) the plan's predicted probabilities */
    /* replay's prefetch log (rc_replay_prefetches): the batch and key of every prefetch
     * issued during the latest rc_replay, in issue order; pf_event_of[f]: f's entry */
    int64_t replay_batch;         /* the batch rc_replay runs, -1 outside it */
    lvec log_batch; ivec log_flat;
    int64_t *pf_event_of;         /* (n_flat,) */
    uint8_t *pinned, *pf_unused;  /* (n_flat,) */
    int32_t *lease_count;         /* (n_flat,) */
    int64_t *seen;                /* (n_flat,) call stamp: first occurrence within a call */
    int64_t call;
    int64_t n_pf_unused;
    int64_t seq, next_ticket;
    int64_t next_lease;           /* the lease ids rc_step mints (step.c), apart from the
                                     manager's (Python's, from 1) */
    rc_policy pol;
    ivec *pins_by_layer;          /* (n_layer,) */
    ivec *last_experts;           /* (3 * n_layer,) chunk-plan history, or NULL */
    lease *leases; int32_t n_leases, cap_leases;
    ticket *tickets; int32_t n_tickets; int64_t cap_tickets;
    /* results of the last call (valid until the next one) */
    ivec r_touched, r_missed, r_missed_row, r_miss_kind, r_admitted, r_evicted, r_transient, r_victims,
         r_aside, r_plan, r_pf_flats, r_pf_nv, r_pf_victims, r_pf_used_row;
    lvec r_tickets, r_new, r_pf_ids;
    int32_t cur_order;            /* the order heap_less compares by */
};

/* ---- ordering -------------------------------------------------------------------------- */

static double score(const rc_core *c, int32_t order, int32_t f) {
    const int64_t *u = c->uses;
    const int32_t n = c->n_flat;
    switch (c->pol.order_kind[order]) {
    case EV_LRU: return (double) c->last_seq[f];
    case EV_LFU: return (double) (u[f] + u[n + f] + u[2 * n + f]);
    case EV_LFU_DECAY: return c->decay_log[f];
    case EV_PHASE_WEIGHTED:
        return c->pol.order_p1[order] * (double) u[f]
             + c->pol.order_p2[order] * (double) (u[n + f] + u[2 * n + f]);
    case EV_NEXT_VISIT: return -nv_expected(c->nv, f);
    default: return -(double) c->next_use[f];
    }
}

/* (score, last seq, flat) of a < b */
static inline int key_less(const rc_core *c, int32_t order, int32_t a, int32_t b) {
    if (c->pol.order_kind[order] == EV_LRU) {       /* score == last seq */
        const int64_t la = c->last_seq[a], lb = c->last_seq[b];
        return la != lb ? la < lb : a < b;
    }
    const double sa = score(c, order, a), sb = score(c, order, b);
    if (sa != sb) return sa < sb;
    if (c->last_seq[a] != c->last_seq[b]) return c->last_seq[a] < c->last_seq[b];
    return a < b;
}

/* the order a heap keeps: the policy's, except next-visit, whose score moves with the layer
 * cycle: its heap is only the pool's resident set (no order) and pop_victim searches it */
static inline int heap_less(const rc_core *c, int32_t order, int32_t a, int32_t b) {
    if (c->pol.order_kind[order] == EV_NEXT_VISIT) return 0;   /* a set: never sifts */
    return key_less(c, order, a, b);
}

/* the protection of layer's keys changed (next-visit's search keeps candidates) */
static inline void nv_stale_layer(const rc_core *c, int32_t layer) {
    if (c->nvv != NULL) nvv_stale(c->nvv, layer);
}

static void heap_swap(heap *h, int32_t i, int32_t j) {
    int32_t a = h->items[i], b = h->items[j];
    h->items[i] = b; h->items[j] = a;
    h->pos[b] = i; h->pos[a] = j;
}

static void sift_up(const rc_core *c, int32_t o, heap *h, int32_t i) {
    while (i > 0) {
        int32_t p = (i - 1) / 2;
        if (!heap_less(c, o, h->items[i], h->items[p])) break;
        heap_swap(h, i, p);
        i = p;
    }
}

static void sift_down(const rc_core *c, int32_t o, heap *h, int32_t i) {
    for (;;) {
        int32_t l = 2 * i + 1, r = l + 1, m = i;
        if (l < h->n && heap_less(c, o, h->items[l], h->items[m])) m = l;
        if (r < h->n && heap_less(c, o, h->items[r], h->items[m])) m = r;
        if (m == i) return;
        heap_swap(h, i, m);
        i = m;
    }
}

static int heap_push(const rc_core *c, int32_t o, heap *h, int32_t f) {
    if (h->pos[f] >= 0) return 0;
    if (c->pol.order_kind[o] == EV_NEXT_VISIT) nvv_push(c->nvv, f);
    if (array_grow((void **) &h->items, &h->cap, (int64_t) h->n + 1, sizeof *h->items))
        return -1;
    h->items[h->n] = f;
    h->pos[f] = h->n++;
    if (c->pol.order_kind[o] != EV_NEXT_VISIT) sift_up(c, o, h, h->n - 1);
    return 0;
}

static void heap_remove(const rc_core *c, int32_t o, heap *h, int32_t f) {
    int32_t i = h->pos[f];
    if (i < 0) return;
    if (c->pol.order_kind[o] == EV_NEXT_VISIT) nvv_remove(c->nvv, f);
    h->n--;
    if (i != h->n) {
        const int32_t moved = h->items[h->n];
        heap_swap(h, i, h->n);
        h->pos[f] = -1;
        if (c->pol.order_kind[o] != EV_NEXT_VISIT) {   /* (next-visit: a set) */
            sift_up(c, o, h, i);
            sift_down(c, o, h, h->pos[moved]);
        }
    } else {
        h->pos[f] = -1;
    }
}

static inline pool *pool_of(rc_core *c, int32_t f) {
    return &c->pools[c->pool_of_flat[f]];
}

static int order_add(rc_core *c, int32_t f) {
    pool *p = pool_of(c, f);
    for (int32_t o = 0; o < c->pol.n_orders; o++)
        if (heap_push(c, o, &p->h[o], f) < 0) return -1;
    return 0;
}

static void order_discard(rc_core *c, int32_t f) {
    pool *p = pool_of(c, f);
    for (int32_t o = 0; o < c->pol.n_orders; o++) heap_remove(c, o, &p->h[o], f);
}

static int protected_key(const rc_core *c, int32_t f, int64_t seq0) {
    return c->last_seq[f] >= seq0 || c->lease_count[f] > 0 || c->pinned[f];
}

/* the lowest unprotected key of the order (taken out of that heap), or -1; protected keys
 * met on the way wait in r_aside until settle() */
static int32_t pop_victim(rc_core *c, pool *p, int32_t o, int64_t seq0) {
    heap *h = &p->h[o];
    if (c->pol.order_kind[o] == EV_NEXT_VISIT) {  /* (at most one order is next-visit: the
                                                     orders are distinct specs, one rate) */
        const int32_t best = nvv_lowest(c->nvv, (int32_t) (p - c->pools), seq0);
        if (best >= 0) heap_remove(c, o, h, best);
        return best;
    }
    while (h->n > 0) {
        int32_t f = h->items[0];
        if (c->pol.order_kind[o] == EV_LRU && c->last_seq[f] >= seq0) return -1;  /* the rest
                                                                       is newer still */
        heap_remove(c, o, h, f);
        if (protected_key(c, f, seq0)) {
            if (ivec_push(&c->r_aside, f) < 0) return -1;
            continue;
        }
        return f;
    }
    return -1;
}

static void settle(rc_core *c, pool *p, int32_t o) {
    for (int32_t i = 0; i < c->r_aside.n; i++) heap_push(c, o, &p->h[o], c->r_aside.v[i]);
    c->r_aside.n = 0;
}

static void unpop(rc_core *c, pool *p, int32_t o, const int32_t *flats, int32_t n) {
    for (int32_t i = 0; i < n; i++) heap_push(c, o, &p->h[o], flats[i]);
}

/* ---- state changes --------------------------------------------------------------------- */

static int make_resident(rc_core *c, int32_t f, int32_t phase, int prefetched) {
    pool *p = pool_of(c, f);
    c->state[f] = (uint8_t) phase;
    p->resident_bytes += c->bytes_flat[f];
    p->resident_count++;
    if (prefetched) {
        c->pf_unused[f] = 1;
        c->n_pf_unused++;
    }
    return order_add(c, f);
}

/* resident (or evicting) -> absent, counted in `phase`'s counters */
static void evict(rc_core *c, int32_t f, int32_t phase) {
    pool *p = pool_of(c, f);
    const int64_t b = c->bytes_flat[f];
    int64_t *t = p->counters[phase];
    if (c->state[f] <= RESIDENT_MAX) {
        p->resident_bytes -= b;
        p->resident_count--;
        order_discard(c, f);
    }
    c->state[f] = ABSENT;
    t[C_EVICTIONS]++;
    t[C_EVICTED_BYTES] += b;
    if (c->pf_unused[f]) {
        c->pf_unused[f] = 0;
        c->n_pf_unused--;
        t[C_PF_WASTED_BYTES] += b;
    }
}

static ticket *find_ticket(const rc_core *c, int64_t id) {
    for (int32_t i = 0; i < c->n_tickets; i++)
        if (c->tickets[i].id == id) return &c->tickets[i];
    return NULL;
}

static ticket *ticket_of_flat(const rc_core *c, int32_t f) {
    for (int32_t i = 0; i < c->n_tickets; i++)
        if (c->tickets[i].flat == f) return &c->tickets[i];
    return NULL;
}

/* reserve: victims stop being hit-able (their bytes move into the claim), the key pends */
static int begin(rc_core *c, int32_t f, int32_t phase, int prefetch, const int32_t *victims,
                 int32_t nv, int64_t *id_out) {
    if (array_grow((void **) &c->tickets, &c->cap_tickets, (int64_t) c->n_tickets + 1,
                   sizeof *c->tickets))
        return -1;
    ticket *t = &c->tickets[c->n_tickets];
    memset(t, 0, sizeof *t);
    t->victims = nv ? malloc((size_t) nv * sizeof *t->victims) : NULL;
    t->before = nv ? malloc((size_t) nv) : NULL;
    if (nv && (t->victims == NULL || t->before == NULL)) {
        free(t->victims); free(t->before);
        return -1;
    }
    pool *p = pool_of(c, f);
    int64_t vb = 0;
    for (int32_t i = 0; i < nv; i++) {
        const int32_t v = victims[i];
        t->victims[i] = v;
        t->before[i] = c->state[v];
        vb += c->bytes_flat[v];
        c->state[v] = EVICTING;
        p->resident_count--;
        order_discard(c, v);
    }
    p->resident_bytes -= vb;
    t->id = c->next_ticket++;
    t->flat = f;
    t->bytes = c->bytes_flat[f];
    t->claim = t->bytes > vb ? t->bytes : vb;
    t->n_victims = nv;
    t->phase = phase;
    t->prefetch = prefetch;
    p->pending_bytes += t->claim;
    p->pending_tickets++;
    c->state[f] = PENDING;
    c->n_tickets++;
    *id_out = t->id;
    return 0;
}

static void finish(rc_core *c, ticket *t) {
    pool *p = pool_of(c, t->flat);
    p->pending_bytes -= t->claim;
    p->pending_tickets--;
    free(t->victims);
    free(t->before);
    *t = c->tickets[--c->n_tickets];
}

/* ---- lifetime -------------------------------------------------------------------------- */

static int rc_set_pools_impl(rc_core *c, int32_t n_pool, const int32_t *pool_of_layer,
                             const int64_t *capacity);
static void rc_release_impl(rc_core *c, int64_t lease_id);

rc_core *rc_create(int32_t n_layer, int32_t n_expert, const int64_t *expert_bytes,
                   const rc_policy *policy) {
    if (n_layer <= 0 || n_expert <= 0 || policy == NULL || policy->n_orders < 1 ||
        policy->n_orders > 3)
        return NULL;
    rc_core *c = calloc(1, sizeof *c);
    if (c == NULL) return NULL;
    const int32_t n = n_layer * n_expert;
    c->n_layer = n_layer;
    c->n_expert = n_expert;
    c->n_flat = n;
    c->pol = *policy;
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
    if (policy->decay_rate > 0) c->decay_log = malloc((size_t) n * sizeof *c->decay_log);
    if (policy->track_next_use) c->next_use = malloc((size_t) n * sizeof *c->next_use);
    int chunk = 0;
    for (int p = 0; p < 3; p++) chunk |= policy->prefetch[p] == PF_CHUNK_PLAN;
    if (chunk) c->last_experts = calloc((size_t) 3 * n_layer, sizeof *c->last_experts);
    if (!c->bytes_flat || !c->pool_of_layer || !c->pool_of_flat || !c->moe_layers || !c->state || !c->last_seq ||
        !c->uses || !c->pinned || !c->pf_unused || !c->lease_count || !c->seen || !c->pf_event_of ||
        !c->pins_by_layer || (policy->decay_rate > 0 && !c->decay_log) ||
        (policy->track_next_use && !c->next_use) || (chunk && !c->last_experts)) {
        rc_free(c);
        return NULL;
    }
    for (int32_t l = 0; l < n_layer; l++) {
        for (int32_t e = 0; e < n_expert; e++) c->bytes_flat[l * n_expert + e] = expert_bytes[l];
        c->pool_of_layer[l] = expert_bytes[l] > 0 ? 0 : -1;
        if (expert_bytes[l] > 0) c->moe_layers[c->n_moe++] = l;
    }
    memset(c->state, ABSENT, (size_t) n);
    for (int32_t o = 0; o < policy->n_orders; o++)
        if (policy->order_kind[o] == EV_NEXT_VISIT && c->nv == NULL) {
            c->nv = nv_create(n_layer, n_expert, c->moe_layers, c->n_moe,
                              policy->nv_learning_rate);
            c->nvv = c->nv == NULL ? NULL
                     : nvv_create(c->nv, n_layer, n_expert, c->moe_layers, c->n_moe,
                                  c->last_seq, c->lease_count, c->pinned);
            if (c->nvv == NULL) {
                rc_free(c);
                return NULL;
            }
        }
    for (int32_t ph = 0; ph < 3; ph++)
        if (policy->prefetch[ph] == PF_AFFINITY && c->af == NULL) {
            int64_t b_max = 0;                    /* the largest expert */
            for (int32_t l = 0; l < n_layer; l++)
                if (expert_bytes[l] > b_max) b_max = expert_bytes[l];
            c->af = af_create(n_layer, n_expert, c->moe_layers, c->n_moe, policy->prefetch_p1[ph],
                              policy->prefetch_p2[ph], policy->prefetch_p3[ph], (double) b_max,
                              policy->affinity_rates, policy->n_expert_used);
            c->af_plan = malloc((size_t) n_expert * sizeof *c->af_plan);
            c->af_q = malloc((size_t) n_expert * sizeof *c->af_q);
            if (c->af == NULL || c->af_plan == NULL || c->af_q == NULL) {
                rc_free(c);
                return NULL;
            }
        }
    for (int32_t i = 0; i < n; i++) {
        c->last_seq[i] = -1;
        if (c->decay_log) c->decay_log[i] = -INFINITY;
        if (c->next_use) c->next_use[i] = NEVER;
    }
    c->next_ticket = 1;
    c->next_lease = ((int64_t) 1) << 50;
    pthread_mutex_init(&c->mu, NULL);
    int64_t unresolved = -1;
    if (rc_set_pools_impl(c, 1, c->pool_of_layer, &unresolved) != RC_OK) {
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
    nv_free(c->nv);
    nvv_free(c->nvv);
    af_free(c->af);
    free(c->af_plan);
    free(c->af_q);
    for (int32_t i = 0; i < c->n_tickets; i++) {
        free(c->tickets[i].victims);
        free(c->tickets[i].before);
    }
    for (int32_t i = 0; i < c->n_leases; i++) free(c->leases[i].experts);
    if (c->pins_by_layer)
        for (int32_t l = 0; l < c->n_layer; l++) free(c->pins_by_layer[l].v);
    if (c->last_experts)
        for (int32_t i = 0; i < 3 * c->n_layer; i++) free(c->last_experts[i].v);
    ivec *iv[] = {&c->r_touched, &c->r_missed, &c->r_missed_row, &c->r_miss_kind, &c->r_admitted,
                  &c->r_evicted, &c->r_transient, &c->r_victims, &c->r_aside, &c->r_plan,
                  &c->r_pf_flats, &c->r_pf_nv, &c->r_pf_victims, &c->r_pf_used_row, &c->log_flat};
    for (size_t i = 0; i < sizeof iv / sizeof *iv; i++) free(iv[i]->v);
    free(c->r_tickets.v); free(c->r_new.v); free(c->r_pf_ids.v); free(c->log_batch.v);
    free(c->pf_event_of);
    free(c->tickets); free(c->leases); free(c->pins_by_layer); free(c->last_experts);
    free(c->bytes_flat); free(c->pool_of_layer); free(c->pool_of_flat); free(c->moe_layers); free(c->state);
    free(c->last_seq); free(c->uses); free(c->decay_log); free(c->next_use); free(c->pinned);
    free(c->pf_unused); free(c->lease_count); free(c->seen);
    free(c);
}

void rc_set_inline(rc_core *c, int32_t inline_transport) { c->pol.inline_transport = inline_transport; }

static int rc_set_pools_impl(rc_core *c, int32_t n_pool, const int32_t *pool_of_layer,
                 const int64_t *capacity) {
    if (n_pool < 1) return RC_ERR_POOL;
    if (c->pools != NULL) {
        for (int32_t p = 0; p < c->n_pool; p++)
            if (c->pools[p].resident_count || c->pools[p].pending_tickets) return RC_ERR_STATE;
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
    if (c->nvv != NULL) nvv_reset(c->nvv, c->pool_of_layer);   /* empty orders */
    return RC_OK;
}

static int rc_set_capacity_impl(rc_core *c, int32_t pool_id, int64_t capacity) {
    if (pool_id < 0 || pool_id >= c->n_pool) return RC_ERR_POOL;
    pool *p = &c->pools[pool_id];
    if (p->pending_tickets) return RC_ERR_PENDING;
    if (capacity >= 0 && capacity < p->resident_bytes + p->pending_bytes) return RC_ERR_CHARGED;
    p->capacity = capacity;
    return RC_OK;
}

int32_t rc_n_pool(const rc_core *c) { return c->n_pool; }
int32_t rc_pool_of_layer(const rc_core *c, int32_t layer) {
    return layer >= 0 && layer < c->n_layer ? c->pool_of_layer[layer] : -1;
}

/* ---- leases ---------------------------------------------------------------------------- */

static int take_lease(rc_core *c, int64_t id, int32_t base, const int32_t *experts, int32_t n) {
    if (c->n_leases == c->cap_leases) {
        int32_t cap = c->cap_leases ? 2 * c->cap_leases : 8;
        lease *v = realloc(c->leases, (size_t) cap * sizeof *v);
        if (v == NULL) return -1;
        c->leases = v; c->cap_leases = cap;
    }
    lease *l = &c->leases[c->n_leases];
    l->experts = malloc((size_t) (n ? n : 1) * sizeof *l->experts);
    if (l->experts == NULL) return -1;
    memcpy(l->experts, experts, (size_t) n * sizeof *experts);
    l->id = id; l->base = base; l->n = n;
    for (int32_t i = 0; i < n; i++) c->lease_count[base + experts[i]]++;
    nv_stale_layer(c, base / c->n_expert);
    c->n_leases++;
    return 0;
}

static void rc_release_impl(rc_core *c, int64_t lease_id) {
    for (int32_t i = 0; i < c->n_leases; i++) {
        lease *l = &c->leases[i];
        if (l->id != lease_id) continue;
        for (int32_t j = 0; j < l->n; j++) c->lease_count[l->base + l->experts[j]]--;
        nv_stale_layer(c, l->base / c->n_expert);
        free(l->experts);
        *l = c->leases[--c->n_leases];
        return;
    }
}

int32_t rc_n_leases(const rc_core *c) { return c->n_leases; }

/* ---- prefetch -------------------------------------------------------------------------- */

static void result_reset(rc_core *c) {
    c->r_touched.n = c->r_missed.n = c->r_missed_row.n = c->r_miss_kind.n = 0;
    c->r_admitted.n = c->r_evicted.n = c->r_transient.n = 0;
    c->r_victims.n = c->r_aside.n = 0;
    c->r_pf_flats.n = c->r_pf_nv.n = c->r_pf_victims.n = c->r_pf_used_row.n = 0;
    c->r_tickets.n = c->r_new.n = c->r_pf_ids.n = 0;
}

static void result_out(rc_core *c, rc_result *out) {
    out->n_admitted = c->r_admitted.n; out->admitted = c->r_admitted.v;
    out->n_evicted = c->r_evicted.n; out->evicted = c->r_evicted.v;
    out->n_transient = c->r_transient.n; out->transient = c->r_transient.v;
    out->n_tickets = c->r_tickets.n; out->tickets = c->r_tickets.v;
    out->n_new_tickets = c->r_new.n; out->new_tickets = c->r_new.v;
    out->n_prefetched = c->r_pf_flats.n; out->prefetched = c->r_pf_flats.v;
    out->prefetch_ids = c->r_pf_ids.v; out->prefetch_n_victims = c->r_pf_nv.v;
    out->prefetch_victims = c->r_pf_victims.v;
}

/* bring `flats` in (priority order) where victims rank strictly below each one */
/* v ranks strictly below f, whose score is `mine` (NAN: its own) */
static int ranks_below(const rc_core *c, int32_t o, int32_t v, int32_t f, double mine) {
    if (mine != mine) return key_less(c, o, v, f);
    const double sv = score(c, o, v);
    if (sv != mine) return sv < mine;
    if (c->last_seq[v] != c->last_seq[f]) return c->last_seq[v] < c->last_seq[f];
    return v < f;
}

/* bring `flats` in (priority order) where victims rank strictly below each one; mine[i]
 * (or NULL) overrides flats[i]'s own score under next-visit (prefetch affinity: its
 * predicted expected time) */
static int prefetch_flats(rc_core *c, const int32_t *flats, int32_t n, int32_t phase,
                          int64_t seq0, const double *mine) {
    const int32_t o = c->pol.phase_order[phase];
    for (int32_t i = 0; i < n; i++) {
        const int32_t f = flats[i];
        if (c->state[f] != ABSENT) continue;
        pool *p = pool_of(c, f);
        if (p->capacity < 0) return 0;
        const int64_t b = c->bytes_flat[f];
        c->last_seq[f] = c->seq++;               /* a prefetch counts as a touch now */
        const int64_t free_b = p->capacity - p->resident_bytes - p->pending_bytes;
        c->r_victims.n = 0;
        int64_t freed = 0;
        const int nv = c->pol.order_kind[o] == EV_NEXT_VISIT;
        const double own = mine != NULL && nv ? mine[i] : NAN;
        while (free_b + freed < b) {
            int32_t v;
            if (nv) {                             /* look before taking: a refused victim */
                v = nvv_lowest(c->nvv, (int32_t) (p - c->pools), seq0);  /* stays in place */
                if (v < 0 || !ranks_below(c, o, v, f, own)) break;       /* (no rescoring) */
                heap_remove(c, o, &p->h[o], v);
            } else {
                v = pop_victim(c, p, o, seq0);
                if (v < 0) break;
                if (!ranks_below(c, o, v, f, own)) {  /* worth as much as what we'd bring */
                    heap_push(c, o, &p->h[o], v);
                    break;
                }
            }
            if (ivec_push(&c->r_victims, v) < 0) return RC_ERR_NOMEM;
            freed += c->bytes_flat[v];
        }
        settle(c, p, o);
        if (free_b + freed < b) {
            unpop(c, p, o, c->r_victims.v, c->r_victims.n);
            continue;
        }
        int64_t *t = p->counters[phase];
        t[C_PF_ISSUED]++;
        t[C_PF_ISSUED_BYTES] += b;
        if (c->replay_batch >= 0) {
            c->pf_event_of[f] = c->log_batch.n;
            if (lvec_push(&c->log_batch, c->replay_batch) < 0 || ivec_push(&c->log_flat, f) < 0)
                return RC_ERR_NOMEM;
        }
        c->pinned[f] = 1;
        if (ivec_push(&c->pins_by_layer[f / c->n_expert], f) < 0) return RC_ERR_NOMEM;
        for (int32_t j = 0; j < c->r_victims.n; j++)
            if (ivec_push(&c->r_pf_victims, c->r_victims.v[j]) < 0) return RC_ERR_NOMEM;
        if (ivec_push(&c->r_pf_flats, f) < 0 || ivec_push(&c->r_pf_nv, c->r_victims.n) < 0)
            return RC_ERR_NOMEM;
        int64_t id;
        if (c->pol.inline_transport) {
            for (int32_t j = 0; j < c->r_victims.n; j++) evict(c, c->r_victims.v[j], phase);
            if (make_resident(c, f, phase, 1) < 0) return RC_ERR_NOMEM;
            id = c->next_ticket++;               /* committed already: nothing to submit */
        } else {
            if (begin(c, f, phase, 1, c->r_victims.v, c->r_victims.n, &id) < 0 ||
                lvec_push(&c->r_new, id) < 0)
                return RC_ERR_NOMEM;
        }
        if (lvec_push(&c->r_pf_ids, id) < 0) return RC_ERR_NOMEM;
    }
    return RC_OK;
}

static int run_prefetch(rc_core *c, int32_t layer, const int32_t *el, int32_t n, int32_t phase,
                        int32_t up_layer, const int32_t *up_e, const int64_t *up_i,
                        int32_t n_up, int64_t seq0) {
    const int32_t kind = c->pol.prefetch[phase];
    const int32_t ne = c->n_expert;
    ivec *plan = &c->r_plan;
    plan->n = 0;
    (void) el;
    if (up_layer >= 0 && c->next_use != NULL) {
        /* the upcoming step's elements are their keys' next uses (first occurrence wins) */
        c->call++;
        c->r_touched.n = 0;
        for (int32_t i = 0; i < n_up; i++) {      /* out of the orders while their keys move */
            const int32_t f = up_layer * ne + up_e[i];
            if (c->seen[f] == c->call) continue;
            c->seen[f] = c->call;
            if (c->state[f] <= RESIDENT_MAX) {
                order_discard(c, f);
                if (ivec_push(&c->r_touched, f) < 0) return RC_ERR_NOMEM;
            }
        }
        for (int32_t i = n_up - 1; i >= 0; i--) c->next_use[up_layer * ne + up_e[i]] = up_i[i];
        for (int32_t i = 0; i < c->r_touched.n; i++)
            if (order_add(c, c->r_touched.v[i]) < 0) return RC_ERR_NOMEM;
    }
    /* the MoE layers after `layer`, ascending */
    int32_t first_next = 0;
    while (first_next < c->n_moe && c->moe_layers[first_next] <= layer) first_next++;
    if (kind == PF_CHUNK_PLAN) {
        if (phase != 0) return RC_OK;
        const int32_t depth = (int32_t) c->pol.prefetch_p1[phase];
        for (int32_t k = first_next; k < c->n_moe && k < first_next + depth; k++) {
            const int32_t l = c->moe_layers[k];
            const ivec *prev = &c->last_experts[0 * c->n_layer + l];
            if (prev->n == 0 && prev->v == NULL) continue;
            /* np.unique: sorted distinct experts */
            uint8_t *mark = calloc((size_t) ne, 1);
            if (mark == NULL) return RC_ERR_NOMEM;
            for (int32_t i = 0; i < prev->n; i++) mark[prev->v[i]] = 1;
            for (int32_t e = 0; e < ne; e++)
                if (mark[e] && ivec_push(plan, l * ne + e) < 0) { free(mark); return RC_ERR_NOMEM; }
            free(mark);
        }
    } else if (kind == PF_POPULARITY) {
        const int32_t top_n = (int32_t) c->pol.prefetch_p1[phase];
        if (first_next >= c->n_moe || top_n <= 0) return RC_OK;
        const int32_t l = c->moe_layers[first_next];
        const int32_t nf = c->n_flat;
        const int32_t top = top_n < ne ? top_n : ne;
        /* most used first, then lower expert id; only keys used at all */
        uint8_t *taken = calloc((size_t) ne, 1);
        if (taken == NULL) return RC_ERR_NOMEM;
        for (int32_t k = 0; k < top; k++) {
            int32_t best = -1;
            int64_t best_u = -1;
            for (int32_t e = 0; e < ne; e++) {
                if (taken[e]) continue;
                const int32_t f = l * ne + e;
                const int64_t u = c->uses[f] + c->uses[nf + f] + c->uses[2 * nf + f];
                if (u > best_u) { best_u = u; best = e; }
            }
            if (best < 0) break;
            taken[best] = 1;
            if (best_u > 0 && ivec_push(plan, l * ne + best) < 0) { free(taken); return RC_ERR_NOMEM; }
        }
        free(taken);
    } else if (kind == PF_BELADY) {
        if (up_layer < 0) return RC_OK;
        c->call++;
        for (int32_t i = 0; i < n_up; i++) {
            const int32_t f = up_layer * ne + up_e[i];
            if (c->seen[f] == c->call) continue;
            c->seen[f] = c->call;
            if (ivec_push(plan, f) < 0) return RC_ERR_NOMEM;
        }
    } else if (kind == PF_AFFINITY) {
        if (phase != 1) return RC_OK;
        const int32_t np = af_plan(c->af, layer, n - c->r_missed.n, c->r_missed.n, c->state,
                                   ABSENT, c->bytes_flat, c->af_plan, c->af_q);
        if (np == 0) return RC_OK;
        double spent = 0.0;                        /* every planned key is absent */
        for (int32_t i = 0; i < np; i++)
            spent = spent + af_transfer_cost(c->af, c->bytes_flat[c->af_plan[i]]);
        const int32_t before = c->r_pf_flats.n;
        double mine[np];
        for (int32_t i = 0; i < np; i++)      /* plan_lead layers ahead: plan_lead + n_moe (1/q - 1) */
            mine[i] = -((double) c->af->plan_lead + (double) c->n_moe * (1.0 / c->af_q[i] - 1.0));
        const int rc = prefetch_flats(c, c->af_plan, np, phase, seq0, mine);
        for (int32_t i = before; i < c->r_pf_flats.n; i++)
            spent = spent - af_transfer_cost(c->af, c->bytes_flat[c->r_pf_flats.v[i]]);
        af_refund(c->af, spent);
        return rc;
    }
    if (plan->n == 0) return RC_OK;
    return prefetch_flats(c, plan->v, plan->n, phase, seq0, NULL);
}

static int rc_prefetch_impl(rc_core *c, const int32_t *flats, int32_t n, int32_t phase, rc_result *out) {
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

/* ---- access ---------------------------------------------------------------------------- */

static int access_static(rc_core *c, int32_t layer, const int32_t *el, int32_t n,
                         int32_t phase, int64_t lease_id, rc_result *out) {
    const int32_t base = layer * c->n_expert;
    c->seq += n;
    c->call++;
    int64_t *t = c->pools[c->pool_of_layer[layer]].counters[phase];
    int32_t m = 0;
    for (int32_t i = 0; i < n; i++) {
        const int32_t f = base + el[i];
        if (c->seen[f] == c->call) continue;
        c->seen[f] = c->call;
        if (c->state[f] > RESIDENT_MAX) {
            if (ivec_push(&c->r_transient, f) < 0) return RC_ERR_NOMEM;
            m++;
        }
    }
    if (lease_id > 0 && take_lease(c, lease_id, base, el, n) < 0) return RC_ERR_NOMEM;
    const int64_t mb = (int64_t) m * c->bytes_flat[base];
    t[C_ACCESSES] += n;
    if (m) {
        t[C_MISSES] += m;
        t[C_DEMAND_BYTES] += mb;
        t[C_TRANSIENT] += m;
        t[C_TRANSIENT_BYTES] += mb;
    }
    out->hits = n - m;
    out->misses = m;
    out->demand_miss_bytes = mb;
    out->n_transient = c->r_transient.n;
    out->transient = c->r_transient.v;
    return RC_OK;
}

static int admission_ok(const rc_core *c, int32_t phase, int32_t f, const int32_t *victims,
                        int32_t nv) {
    const int32_t nf = c->n_flat;
    switch (c->pol.admission[phase]) {
    case AD_REUSE:
        if (phase == 0) return 1;
        return (double) (c->uses[f] + c->uses[nf + f] + c->uses[2 * nf + f])
               >= c->pol.admission_p1[phase];
    case AD_TOP:
        if (nv == 0) return 1;
        return (double) (c->last_seq[f] - c->last_seq[victims[0]]) > c->pol.admission_p1[phase];
    case AD_BELADY_BYPASS:
        if (nv == 0) return 1;
        return c->next_use[f] < c->next_use[victims[0]];
    default:
        return 1;
    }
}

static int handle_misses(rc_core *c, int32_t base, int32_t phase, int64_t seq0) {
    const int32_t o = c->pol.phase_order[phase];
    pool *p = pool_of(c, base);
    int64_t *t = p->counters[phase];
    const int64_t b = c->bytes_flat[base];
    const int32_t m = c->r_missed.n;
    t[C_MISSES] += m;
    t[C_DEMAND_BYTES] += (int64_t) m * b;
    int32_t n_transient = 0;
    for (int32_t i = 0; i < m; i++) {
        const int32_t f = c->r_missed.v[i];
        const uint8_t s = c->state[f];
        if (s == PENDING) {                       /* already in flight: join that transfer */
            if (lvec_push(&c->r_tickets, ticket_of_flat(c, f)->id) < 0 ||
                ivec_push(&c->r_miss_kind, 3) < 0)
                return RC_ERR_NOMEM;
            continue;
        }
        if (p->capacity < 0 || s == EVICTING) {
            if (ivec_push(&c->r_transient, f) < 0 || ivec_push(&c->r_miss_kind, 2) < 0)
                return RC_ERR_NOMEM;
            n_transient++;
            continue;
        }
        const int64_t free_b = p->capacity - p->resident_bytes - p->pending_bytes;
        c->r_victims.n = 0;
        if (free_b < b) {
            int64_t freed = 0;
            while (free_b + freed < b) {
                int32_t v = pop_victim(c, p, o, seq0);
                if (v < 0) break;
                if (ivec_push(&c->r_victims, v) < 0) return RC_ERR_NOMEM;
                freed += c->bytes_flat[v];
            }
            settle(c, p, o);
            if (free_b + freed < b) {             /* everything evictable is protected */
                unpop(c, p, o, c->r_victims.v, c->r_victims.n);
                if (ivec_push(&c->r_transient, f) < 0 || ivec_push(&c->r_miss_kind, 2) < 0)
                    return RC_ERR_NOMEM;
                n_transient++;
                continue;
            }
        }
        if (!admission_ok(c, phase, f, c->r_victims.v, c->r_victims.n)) {
            unpop(c, p, o, c->r_victims.v, c->r_victims.n);
            if (ivec_push(&c->r_transient, f) < 0 || ivec_push(&c->r_miss_kind, 2) < 0)
                return RC_ERR_NOMEM;
            n_transient++;
            continue;
        }
        if (ivec_push(&c->r_admitted, f) < 0 || ivec_push(&c->r_miss_kind, 1) < 0)
            return RC_ERR_NOMEM;
        for (int32_t j = 0; j < c->r_victims.n; j++)
            if (ivec_push(&c->r_evicted, c->r_victims.v[j]) < 0) return RC_ERR_NOMEM;
        if (c->pol.inline_transport) {
            for (int32_t j = 0; j < c->r_victims.n; j++) evict(c, c->r_victims.v[j], phase);
            if (make_resident(c, f, phase, 0) < 0) return RC_ERR_NOMEM;
            t[C_ADMISSIONS]++;
            t[C_ADMITTED_BYTES] += b;
        } else {
            int64_t id;
            if (begin(c, f, phase, 0, c->r_victims.v, c->r_victims.n, &id) < 0) return RC_ERR_NOMEM;
            if (lvec_push(&c->r_tickets, id) < 0 || lvec_push(&c->r_new, id) < 0) return RC_ERR_NOMEM;
        }
    }
    if (n_transient) {
        t[C_TRANSIENT] += n_transient;
        t[C_TRANSIENT_BYTES] += (int64_t) n_transient * b;
    }
    return RC_OK;
}

static int rc_access_impl(rc_core *c, int32_t layer, const int32_t *el, int32_t n, int32_t phase,
              const int64_t *next_use, int32_t up_layer, const int32_t *up_experts,
              const int64_t *up_index, int32_t n_up, int64_t lease_id, int64_t release_id,
              rc_result *out) {
    result_reset(c);
    memset(out, 0, sizeof *out);
    if (release_id > 0) rc_release_impl(c, release_id);
    /* 1. checks: nothing changes on a rejected call */
    if (layer < 0 || layer >= c->n_layer || c->pool_of_layer[layer] < 0) {
        out->bad_value = layer;
        return RC_ERR_LAYER;
    }
    for (int32_t i = 0; i < n; i++)
        if (el[i] < 0 || el[i] >= c->n_expert) {
            out->bad_value = el[i];
            return RC_ERR_EXPERT;
        }
    if (c->is_static) return access_static(c, layer, el, n, phase, lease_id, out);
    if (c->pol.prefetch[phase] == PF_BELADY && up_layer < 0) return RC_ERR_UPCOMING;
    if (c->next_use != NULL && next_use == NULL) return RC_ERR_NEXT_USE;
    const int32_t base = layer * c->n_expert;
    const int32_t nf = c->n_flat;
    const int64_t seq0 = c->seq;
    int64_t seq = seq0;
    c->seq = seq0 + n;
    c->call++;
    const int64_t call = c->call;
    const double rate = c->pol.decay_rate;
    int32_t tr = 0;
    if (c->nv != NULL) {
        nv_visit(c->nv, layer, el, n, phase, nvv_members(c->nvv, layer));
        nvv_stale(c->nvv, layer);                 /* its keys' z moved */
    }
    if (c->af != NULL && af_observe(c->af, layer, el, n, phase) < 0) return RC_ERR_NOMEM;
    /* 2. touch every element in routing order */
    for (int32_t i = 0; i < n; i++) {
        const int32_t f = base + el[i];
        const uint8_t s = c->state[f];
        if (s > RESIDENT_MAX) {
            if (c->seen[f] != call && (ivec_push(&c->r_missed, f) < 0 ||
                                       ivec_push(&c->r_missed_row, i) < 0))
                return RC_ERR_NOMEM;
        } else {
            if (s == 0) tr++;
            if (c->seen[f] != call) {             /* out of the orders while its key moves */
                order_discard(c, f);
                if (ivec_push(&c->r_touched, f) < 0) return RC_ERR_NOMEM;
            }
        }
        c->seen[f] = call;
        c->last_seq[f] = seq;
        c->uses[phase * nf + f]++;
        if (c->decay_log != NULL) {
            const double a = c->decay_log[f], x = rate * (double) seq;
            const double hi = a > x ? a : x, lo = a > x ? x : a;
            c->decay_log[f] = hi + log1p(exp(lo - hi));
        }
        if (c->next_use != NULL) c->next_use[f] = next_use[i];
        seq++;
    }
    for (int32_t i = 0; i < c->r_touched.n; i++)   /* back in, at their new keys */
        if (order_add(c, c->r_touched.v[i]) < 0) return RC_ERR_NOMEM;
    /* 3. lease, pins, history, prefetch use */
    if (lease_id > 0 && take_lease(c, lease_id, base, el, n) < 0) return RC_ERR_NOMEM;
    ivec *pins = &c->pins_by_layer[layer];
    for (int32_t i = 0; i < pins->n; i++) c->pinned[pins->v[i]] = 0;
    if (pins->n) nv_stale_layer(c, layer);
    pins->n = 0;
    if (c->last_experts != NULL) {
        ivec *h = &c->last_experts[phase * c->n_layer + layer];
        h->n = 0;
        for (int32_t i = 0; i < n; i++)
            if (ivec_push(h, el[i]) < 0) return RC_ERR_NOMEM;
        if (h->v == NULL && ivec_push(h, 0) == 0) h->n = 0;   /* recorded, even if empty */
    }
    pool *p = &c->pools[c->pool_of_layer[layer]];
    int64_t *t = p->counters[phase];
    t[C_ACCESSES] += n;
    if (c->n_pf_unused) {
        int32_t used = 0;
        for (int32_t i = 0; i < n; i++) {
            const int32_t f = base + el[i];
            if (c->pf_unused[f]) {
                c->pf_unused[f] = 0;
                used++;
                if (c->replay_batch >= 0 && ivec_push(&c->r_pf_used_row, i) < 0)
                    return RC_ERR_NOMEM;
            }
        }
        if (used) {
            c->n_pf_unused -= used;
            t[C_PF_USED_BYTES] += (int64_t) used * c->bytes_flat[base];
        }
    }
    if (phase != 1) tr = 0;
    t[C_TRANSITION_HITS] += tr;
    /* 4. misses */
    int rc = RC_OK;
    if (c->r_missed.n) rc = handle_misses(c, base, phase, seq0);
    /* 5. prefetch */
    if (rc == RC_OK && phase != 2 && c->pol.prefetch[phase] != PF_NONE)
        rc = run_prefetch(c, layer, el, n, phase, up_layer, up_experts, up_index, n_up, seq0);
    out->hits = n - c->r_missed.n;
    out->misses = c->r_missed.n;
    out->transition_hits = tr;
    out->demand_miss_bytes = (int64_t) c->r_missed.n * c->bytes_flat[base];
    result_out(c, out);
    return rc;
}

static int rc_replay_impl(rc_core *c, int64_t n_batches, const int64_t *starts, const int32_t *layers,
              const int8_t *phases, const int32_t *experts, const int64_t *next_use,
              int32_t with_upcoming, int8_t *miss_kind, int64_t *pf_event) {
    rc_result r;
    c->log_batch.n = c->log_flat.n = 0;
    for (int64_t b = 0; b < n_batches; b++) {
        c->replay_batch = b;
        const int64_t s = starts[b], e = starts[b + 1];
        int32_t up_layer = -1, n_up = 0;
        const int32_t *up_e = NULL;
        int64_t *up_i = NULL;
        if (with_upcoming) {
            if (b + 1 < n_batches) {
                up_layer = layers[b + 1];
                up_e = experts + e;
                n_up = (int32_t) (starts[b + 2] - e);
                up_i = malloc((size_t) (n_up ? n_up : 1) * sizeof *up_i);
                if (up_i == NULL) return RC_ERR_NOMEM;
                for (int32_t i = 0; i < n_up; i++) up_i[i] = e + i;
            } else {
                up_layer = layers[b];   /* none after the last: an empty upcoming step */
            }
        }
        int rc = rc_access_impl(c, layers[b], experts + s, (int32_t) (e - s), phases[b],
                           next_use ? next_use + s : NULL, up_layer, up_e, up_i, n_up, 0, 0, &r);
        free(up_i);
        if (rc != RC_OK) {
            c->replay_batch = -1;
            return rc;
        }
        if (miss_kind != NULL) {
            memset(miss_kind + s, 0, (size_t) (e - s));
            for (int32_t i = 0; i < c->r_missed.n; i++)
                miss_kind[s + c->r_missed_row.v[i]] = (int8_t) c->r_miss_kind.v[i];
            for (int32_t i = 0; i < c->r_pf_used_row.n; i++) {
                const int32_t row = c->r_pf_used_row.v[i];
                miss_kind[s + row] = 4;
                if (pf_event != NULL)
                    pf_event[s + row] = c->pf_event_of[layers[b] * c->n_expert + experts[s + row]];
            }
        }
    }
    c->replay_batch = -1;
    return RC_OK;
}

/* ---- tickets --------------------------------------------------------------------------- */

static int rc_ticket_impl(const rc_core *c, int64_t id, rc_ticket_info *out) {
    const ticket *t = find_ticket(c, id);
    if (t == NULL) return RC_ERR_STATE;
    out->id = t->id; out->flat = t->flat; out->phase = t->phase; out->prefetch = t->prefetch;
    out->n_victims = t->n_victims; out->bytes = t->bytes; out->victims = t->victims;
    return RC_OK;
}

int32_t rc_pending_tickets(const rc_core *c) { return c->n_tickets; }

static int rc_commit_impl(rc_core *c, int64_t id) {
    ticket *t = find_ticket(c, id);
    if (t == NULL) return 0;
    const int32_t f = t->flat, phase = t->phase, prefetch = t->prefetch;
    const int64_t bytes = t->bytes;
    for (int32_t i = 0; i < t->n_victims; i++) evict(c, t->victims[i], phase);
    pool *p = pool_of(c, f);
    finish(c, t);
    c->last_seq[f] = c->seq++;               /* arrival counts as a touch */
    if (make_resident(c, f, phase, prefetch) < 0) return RC_ERR_NOMEM;
    if (!prefetch) {
        p->counters[phase][C_ADMISSIONS]++;
        p->counters[phase][C_ADMITTED_BYTES] += bytes;
    }
    return 1;
}

static int rc_abort_impl(rc_core *c, int64_t id) {
    ticket *t = find_ticket(c, id);
    if (t == NULL) return 0;
    pool *p = pool_of(c, t->flat);
    for (int32_t i = 0; i < t->n_victims; i++) {
        const int32_t v = t->victims[i];
        c->state[v] = t->before[i];
        p->resident_bytes += c->bytes_flat[v];
        p->resident_count++;
        order_add(c, v);
    }
    c->state[t->flat] = ABSENT;
    c->pinned[t->flat] = 0;
    nv_stale_layer(c, t->flat / c->n_expert);
    finish(c, t);
    return 1;
}

static int rc_forget_impl(rc_core *c, int32_t f) {
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

static int rc_pin_static_impl(rc_core *c, const int32_t *flats, int32_t n) {
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

/* ---- queries --------------------------------------------------------------------------- */

int32_t rc_state(const rc_core *c, int32_t f) {
    return f >= 0 && f < c->n_flat ? c->state[f] : -1;
}
const uint8_t *rc_states(const rc_core *c) { return c->state; }
const int64_t *rc_uses(const rc_core *c) { return c->uses; }
int64_t rc_pool_capacity(const rc_core *c, int32_t p) { return c->pools[p].capacity; }
int64_t rc_pool_resident_bytes(const rc_core *c, int32_t p) { return c->pools[p].resident_bytes; }
int64_t rc_pool_resident_count(const rc_core *c, int32_t p) { return c->pools[p].resident_count; }
int64_t rc_pool_pending_bytes(const rc_core *c, int32_t p) { return c->pools[p].pending_bytes; }
int32_t rc_pool_pending_tickets(const rc_core *c, int32_t p) { return c->pools[p].pending_tickets; }
int64_t rc_counter(const rc_core *c, int32_t p, int32_t phase, int32_t k) {
    return c->pools[p].counters[phase][k];
}

static int heap_ok(const rc_core *c, int32_t o, const heap *h) {
    for (int32_t i = 0; i < h->n; i++) {
        if (h->pos[h->items[i]] != i) return 0;
        if (i > 0 && heap_less(c, o, h->items[i], h->items[(i - 1) / 2])) return 0;
    }
    return 1;
}

static int rc_verify_impl(const rc_core *c) {
    for (int32_t pi = 0; pi < c->n_pool; pi++) {
        const pool *p = &c->pools[pi];
        int64_t bytes = 0, count = 0, claims = 0;
        int32_t pending = 0;
        for (int32_t f = 0; f < c->n_flat; f++) {
            if (c->pool_of_layer[f / c->n_expert] != pi) continue;
            if (c->state[f] <= RESIDENT_MAX) {
                bytes += c->bytes_flat[f];
                count++;
                for (int32_t o = 0; o < c->pol.n_orders; o++)
                    if (p->h[o].pos[f] < 0) return 1;              /* an order lost a key */
            } else {
                for (int32_t o = 0; o < c->pol.n_orders; o++)
                    if (p->h[o].pos[f] >= 0) return 2;             /* a stale key ordered */
            }
        }
        for (int32_t i = 0; i < c->n_tickets; i++)
            if (c->pool_of_layer[c->tickets[i].flat / c->n_expert] == pi) {
                claims += c->tickets[i].claim;
                pending++;
            }
        if (bytes != p->resident_bytes || count != p->resident_count) return 3;
        if (claims != p->pending_bytes || pending != p->pending_tickets) return 4;
        if (p->capacity < 0 ? (bytes || claims) : bytes + claims > p->capacity) return 5;
        for (int32_t o = 0; o < c->pol.n_orders; o++)
            if (!heap_ok(c, o, &p->h[o])) return 6;
    }
    int64_t n_pf = 0;
    for (int32_t f = 0; f < c->n_flat; f++) {
        n_pf += c->pf_unused[f];
        if (c->state[f] == PENDING && ticket_of_flat(c, f) == NULL) return 7;
        if (c->lease_count[f] < 0) return 8;
    }
    for (int32_t i = 0; i < c->n_tickets; i++) {
        if (c->state[c->tickets[i].flat] != PENDING) return 7;
        for (int32_t j = 0; j < c->tickets[i].n_victims; j++)
            if (c->state[c->tickets[i].victims[j]] != EVICTING) return 9;
    }
    if (n_pf != c->n_pf_unused) return 10;
    if (c->nvv != NULL && nvv_verify(c->nvv)) return 11;  /* next-visit's lists */
    return 0;
}

/* ---- the public entry points: each holds the core's mutex --------------------------------- */

#define LOCKED(call) do { pthread_mutex_lock(&c->mu); int rc_ = (call); pthread_mutex_unlock(&c->mu); return rc_; } while (0)

int rc_set_pools(rc_core *c, int32_t n_pool, const int32_t *pool_of_layer, const int64_t *capacity) {
    LOCKED(rc_set_pools_impl(c, n_pool, pool_of_layer, capacity));
}
int rc_set_capacity(rc_core *c, int32_t pool, int64_t capacity) { LOCKED(rc_set_capacity_impl(c, pool, capacity)); }
void rc_release(rc_core *c, int64_t lease_id) {
    pthread_mutex_lock(&c->mu);
    rc_release_impl(c, lease_id);
    pthread_mutex_unlock(&c->mu);
}
int rc_prefetch(rc_core *c, const int32_t *flats, int32_t n, int32_t phase, rc_result *out) {
    LOCKED(rc_prefetch_impl(c, flats, n, phase, out));
}
int rc_access(rc_core *c, int32_t layer, const int32_t *el, int32_t n, int32_t phase,
              const int64_t *next_use, int32_t up_layer, const int32_t *up_experts,
              const int64_t *up_index, int32_t n_up, int64_t lease_id, int64_t release_id,
              rc_result *out) {
    LOCKED(rc_access_impl(c, layer, el, n, phase, next_use, up_layer, up_experts, up_index, n_up,
                          lease_id, release_id, out));
}
int rc_replay(rc_core *c, int64_t n_batches, const int64_t *starts, const int32_t *layers,
              const int8_t *phases, const int32_t *experts, const int64_t *next_use,
              int32_t with_upcoming, int8_t *miss_kind, int64_t *pf_event) {
    LOCKED(rc_replay_impl(c, n_batches, starts, layers, phases, experts, next_use, with_upcoming,
                          miss_kind, pf_event));
}
int rc_warm_start(rc_core *c, const double *frequency, const int32_t *pair,
                  const int32_t *count, const int16_t *history, int32_t n_history,
                  int32_t history_k) {
    pthread_mutex_lock(&c->mu);
    if (c->nv != NULL && frequency != NULL) nv_warm_start(c->nv, frequency);
    if (c->af != NULL && pair != NULL && count != NULL) af_warm_start(c->af, pair, count);
    if (c->af != NULL && c->af->nb != NULL && history != NULL && history_k > 0)
        nb_warm_start(c->af->nb, history, n_history, history_k);
    if (c->nvv != NULL) nvv_stale_all(c->nvv);
    pthread_mutex_unlock(&c->mu);
    return RC_OK;
}

int64_t rc_replay_prefetches(const rc_core *c, const int64_t **batch, const int32_t **flat) {
    *batch = c->log_batch.v;
    *flat = c->log_flat.v;
    return c->log_batch.n;
}
int rc_ticket(const rc_core *cc, int64_t id, rc_ticket_info *out) {
    rc_core *c = (rc_core *) cc;
    LOCKED(rc_ticket_impl(c, id, out));
}
int rc_commit(rc_core *c, int64_t id) { LOCKED(rc_commit_impl(c, id)); }
int rc_abort(rc_core *c, int64_t id) { LOCKED(rc_abort_impl(c, id)); }
int rc_forget(rc_core *c, int32_t flat) { LOCKED(rc_forget_impl(c, flat)); }
int rc_pin_static(rc_core *c, const int32_t *flats, int32_t n) { LOCKED(rc_pin_static_impl(c, flats, n)); }
int rc_verify(const rc_core *cc) {
    rc_core *c = (rc_core *) cc;
    LOCKED(rc_verify_impl(c));
}

int64_t rc_lease_id(rc_core *c) { return __atomic_fetch_add(&c->next_lease, 1, __ATOMIC_RELAXED); }

int64_t rc_bench_live(rc_core *c, int64_t n_steps, const int32_t *layers, const int32_t *experts,
                      int32_t k, int32_t phase) {
    rc_result r;
    int64_t held = 0, hits = 0;
    for (int64_t i = 0; i < n_steps; i++) {
        const int rc = rc_step(c, &held, layers[i], experts + i * k, k, phase, &r);
        if (rc != 0) return rc;
        hits += r.hits;
    }
    rc_step_end(c, &held);
    return hits;
}

void rc_next_use(const int64_t *keys, int64_t n, int64_t n_keys, int64_t never, int64_t *out) {
    int64_t *last = malloc((size_t) (n_keys > 0 ? n_keys : 1) * sizeof *last);
    if (last == NULL) {
        for (int64_t i = 0; i < n; i++) out[i] = never;
        return;
    }
    for (int64_t k = 0; k < n_keys; k++) last[k] = never;
    for (int64_t i = n - 1; i >= 0; i--) {
        out[i] = last[keys[i]];
        last[keys[i]] = i;
    }
    free(last);
}
