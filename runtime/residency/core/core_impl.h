/* core_impl: the residency core's private parts, shared by its files (not part of the cdef).
 *
 *   residency_core.c  lifetime, pools, leases, access (the rules, in order), replay
 *   api.c             the public entry points (each takes the core's mutex), queries
 *   order.c           the eviction orders behind one interface (rc_order_ops) and the one
 *                     victim loop (take_victims)
 *   policies.c        the pure per-policy functions: each eviction score, each admission rule
 *   prefetch.c        the prefetch planners behind one interface (rc_planner) and the one
 *                     prefetch loop (prefetch_flats)
 *   verify.c          rc_verify: every bookkeeping invariant
 *
 * Adding an eviction policy: its score in policies.c and one row of RC_ORDER_KINDS; an
 * admission rule: one function and one row of RC_ADMIT; a planner: one plan function and one
 * row of RC_PLANNERS (prefetch.c); plus the policy's Python reference class and registry line
 * (runtime/residency/policies/registry.py).
 */
#ifndef CORE_IMPL_H
#define CORE_IMPL_H
#include "residency_core.h"
#include "next_visit.h"
#include "nv_victim.h"
#include "affinity.h"
#include "grow.h"

#include <pthread.h>
#include <stdint.h>

#define RESIDENT_MAX 2            /* states 0..2: resident, admitted in that phase */
#define ABSENT 8
#define NEVER (((int64_t) 1) << 62)

/* the C kinds (rc_policy; the Python registry names them) */
enum { EV_LRU, EV_LFU, EV_LFU_DECAY, EV_PHASE_WEIGHTED, EV_BELADY, EV_NEXT_VISIT, EV_N_KINDS };
enum { AD_ALWAYS, AD_REUSE, AD_TOP, AD_BELADY_BYPASS, AD_N_KINDS };
enum { PF_NONE, PF_CHUNK_PLAN, PF_POPULARITY, PF_BELADY, PF_AFFINITY, PF_N_KINDS };
enum { C_ACCESSES, C_MISSES, C_DEMAND_BYTES, C_ADMISSIONS, C_ADMITTED_BYTES, C_TRANSIENT,
       C_TRANSIENT_BYTES, C_EVICTIONS, C_EVICTED_BYTES, C_PF_ISSUED, C_PF_ISSUED_BYTES,
       C_PF_USED_BYTES, C_PF_WASTED_BYTES, C_TRANSITION_HITS };

typedef struct { int32_t *v; int32_t n; int64_t cap; } ivec;
typedef struct { int64_t *v; int32_t n; int64_t cap; } lvec;

static inline int ivec_push(ivec *a, int32_t x) {
    if (array_grow((void **) &a->v, &a->cap, (int64_t) a->n + 1, sizeof *a->v)) return -1;
    a->v[a->n++] = x;
    return 0;
}

static inline int lvec_push(lvec *a, int64_t x) {
    if (array_grow((void **) &a->v, &a->cap, (int64_t) a->n + 1, sizeof *a->v)) return -1;
    a->v[a->n++] = x;
    return 0;
}

/* one order's keys in one pool: pos[f] >= 0 iff f is in it; a heap order keeps items a binary
 * min-heap of its key (score, last seq, flat), next-visit's only a set (its index orders) */
typedef struct { int32_t *items; int32_t n; int64_t cap; int32_t *pos; } heap;

typedef struct {
    int64_t capacity, resident_bytes, resident_count;
    heap h[3];
    int64_t counters[3][RC_N_COUNTERS];
} pool;

typedef struct { int64_t id; int32_t base, n; int32_t *experts; } lease;

struct rc_core {
    pthread_mutex_t mu;           /* every public entry point holds it (api.c) */
    int32_t n_layer, n_expert, n_flat, n_pool, is_static;
    int64_t *bytes_flat;          /* (n_flat,) bytes of one expert */
    int32_t *pool_of_layer;       /* (n_layer,) -1: dense */
    int32_t *pool_of_flat;        /* (n_flat,) the same per key */
    int32_t *moe_layers; int32_t n_moe;
    pool *pools;
    uint8_t *state;               /* (n_flat,) 0..2 resident (admitting phase), ABSENT */
    int64_t *last_seq;            /* (n_flat,) */
    int64_t *uses;                /* (3, n_flat) routed count per phase */
    double *decay_log;            /* (n_flat,) or NULL */
    int64_t *next_use;            /* (n_flat,) or NULL */
    nv_model *nv;                 /* the next-visit order's model, or NULL (order.c) */
    nv_victim *nvv;               /* the next-visit order's index, or NULL (order.c) */
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
    int64_t seq;
    int64_t next_lease;           /* the next lease id (rc_lease_id: every lease's, from 1) */
    rc_policy pol;
    ivec *pins_by_layer;          /* (n_layer,) */
    ivec *last_experts;           /* (3 * n_layer,) chunk-plan history, or NULL */
    lease *leases; int32_t n_leases, cap_leases;
    /* results of the last call (valid until the next one) */
    ivec r_touched, r_missed, r_missed_row, r_miss_kind, r_admitted, r_evicted, r_transient,
         r_victims, r_aside, r_plan, r_pf_flats, r_pf_nv, r_pf_victims, r_pf_used_row;
};

static inline pool *pool_of(rc_core *c, int32_t f) { return &c->pools[c->pool_of_flat[f]]; }
/* how often f was routed, every phase together (lfu's score, reuse admission, popularity) */
static inline int64_t total_uses(const rc_core *c, int32_t f) {
    const int32_t n = c->n_flat;
    return c->uses[f] + c->uses[n + f] + c->uses[2 * n + f];
}

/* ---- policies.c: pure functions of the core's statistics ------------------------------ */
typedef double (*rc_score_fn)(const rc_core *c, int32_t order, int32_t f);
typedef int (*rc_admit_fn)(const rc_core *c, int32_t phase, int32_t f, const int32_t *victims,
                           int32_t n_victims);
double rc_score(const rc_core *c, int32_t order, int32_t f);   /* the order's score of f */
/* may f (a demand miss) be admitted over victims (the order's lowest first)? */
int rc_admit(const rc_core *c, int32_t phase, int32_t f, const int32_t *victims, int32_t nv);

/* ---- order.c: the eviction order interface -------------------------------------------- */
typedef struct {
    int (*push)(rc_core *c, pool *p, int32_t o, int32_t f);      /* f joins (0, -1 nomem) */
    void (*remove)(rc_core *c, pool *p, int32_t o, int32_t f);   /* f leaves (if in) */
    /* the lowest unprotected key, left in the order, or -1; protected keys met on the way
     * may wait in c->r_aside until settle() */
    int32_t (*lowest)(rc_core *c, pool *p, int32_t o, int64_t seq0);
    /* does v rank strictly below f, whose score is `own` (NAN: its own)? */
    int (*ranks_below)(const rc_core *c, int32_t o, int32_t v, int32_t f, double own);
    /* optional (NULL: nothing to do): the order's own state (rc_create, rc_free, new pools),
     * a layer-step's experts before any is touched, the protection of a layer's keys
     * changed, a profile's warm start, its own invariants (0 ok) */
    int (*create)(rc_core *c);
    void (*destroy)(rc_core *c);
    void (*reset)(rc_core *c);
    void (*visit)(rc_core *c, int32_t layer, const int32_t *experts, int32_t n, int32_t phase);
    void (*stale)(const rc_core *c, int32_t layer);
    void (*warm_start)(rc_core *c, const double *frequency);
    int (*verify)(const rc_core *c);
} rc_order_ops;

typedef struct {
    const rc_order_ops *ops;
    rc_score_fn score;
    int planned_scores;           /* a planner's own scores (expected layer-steps to the next
                                     use: prefetch affinity's) rank its keys in this order */
} rc_order_kind;
extern const rc_order_kind RC_ORDER_KINDS[EV_N_KINDS];

static inline const rc_order_ops *order_ops(const rc_core *c, int32_t o) {
    return RC_ORDER_KINDS[c->pol.order_kind[o]].ops;
}

int order_create(rc_core *c);                      /* the orders' own state (rc_create) */
void order_free(rc_core *c);
void order_reset(rc_core *c);                      /* every order empty (new pools) */
/* order_add (f joins every order of its pool), order_discard (f leaves them): order_heap.h */
void order_stale(const rc_core *c, int32_t layer); /* the protection of layer's keys changed */
/* a layer-step's experts before any is touched (next-visit learns from them) */
void order_visit(rc_core *c, int32_t layer, const int32_t *experts, int32_t n, int32_t phase);
void order_warm_start(rc_core *c, const double *frequency);
int order_verify(const rc_core *c);                /* 0 ok, else rc_verify's code */
int protected_key(const rc_core *c, int32_t f, int64_t seq0);
/* The one victim loop: free `need` bytes of pool p in order o's lowest unprotected keys
 * (into c->r_victims); with `bounded`, only keys that rank strictly below f (score `own`, NAN:
 * its own). 1: they free enough, taken out of the order; 0: they do not, and stay in it. */
int take_victims(rc_core *c, pool *p, int32_t o, int64_t seq0, int64_t need, int bounded,
                 int32_t f, double own);
/* victims taken but not used go back into the order */
void untake_victims(rc_core *c, pool *p, int32_t o);

/* ---- residency_core.c: state changes ---------------------------------------------------- */
int make_resident(rc_core *c, int32_t f, int32_t phase, int prefetched);
void evict(rc_core *c, int32_t f, int32_t phase);

/* ---- prefetch.c --------------------------------------------------------------------------- */
/* what a planner sees of the layer-step that ran */
typedef struct {
    int32_t layer, n, phase, n_missed;
    int32_t up_layer, n_up;
    const int32_t *experts, *up_experts;
    const int64_t *up_index;
    int32_t first_next;           /* index into moe_layers of the first MoE layer after it */
} rc_step_view;
/* a planner: the keys to bring in, priority order, into plan (+ *mine: their own scores, or
 * left NULL); RC_OK, or an error. Pure but for its own model. */
typedef struct {
    int (*plan)(rc_core *c, const rc_step_view *s, ivec *plan, const double **mine);
    /* optional: after the plan was brought in (its keys from r_pf_flats[first_brought] on) */
    void (*after)(rc_core *c, const ivec *plan, int32_t first_brought);
} rc_planner;
extern const rc_planner RC_PLANNERS[PF_N_KINDS];
int run_prefetch(rc_core *c, const rc_step_view *s, int64_t seq0);
int prefetch_flats(rc_core *c, const int32_t *flats, int32_t n, int32_t phase, int64_t seq0,
                   const double *mine);

/* ---- the unlocked bodies of the entry points (api.c locks) ---------------------------------- */
int core_set_pools(rc_core *c, int32_t n_pool, const int32_t *pool_of_layer,
                   const int64_t *capacity);
int core_set_capacity(rc_core *c, int32_t pool, int64_t capacity);
void core_release(rc_core *c, int64_t lease_id);
int core_access(rc_core *c, int32_t layer, const int32_t *el, int32_t n, int32_t phase,
                const int64_t *next_use, int32_t up_layer, const int32_t *up_experts,
                const int64_t *up_index, int32_t n_up, int64_t lease_id, int64_t release_id,
                rc_result *out);
int core_replay(rc_core *c, int64_t n_batches, const int64_t *starts, const int32_t *layers,
                const int8_t *phases, const int32_t *experts, const int64_t *next_use,
                int32_t with_upcoming, int8_t *miss_kind, int64_t *pf_event);
int core_prefetch(rc_core *c, const int32_t *flats, int32_t n, int32_t phase, rc_result *out);
int core_forget(rc_core *c, int32_t f);
int core_pin_static(rc_core *c, const int32_t *flats, int32_t n);
int core_verify(const rc_core *c);
void result_reset(rc_core *c);
void result_out(rc_core *c, rc_result *out);

#endif
