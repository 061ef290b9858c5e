/* core_impl: the residency core's private parts, shared by its files (not part of the cdef).
 *
 *   step.c            rc_step (one consumer's layer-step) and rc_bench_live; calls api.c
 *   api.c             the public entry points (each takes the core's mutex), queries
 *   residency_core.c  access (the rules, in order), replay
 *   lifetime.c        create, free, pools; the policies resolved by kind (rc_policy_kind)
 *   verify.c          rc_verify: every bookkeeping invariant
 *   prefetch.c        the one prefetch loop (prefetch_flats) a planner's plan goes through
 *   state.c           every change of a key's residency (make_resident, evict, forget, the
 *                     static placement) and a call's results
 *   leases.c          the holds (leases, prefetch pins), each told to the orders (order_hold)
 *   policies/         one policy a file: its pure function(s), its parameter block, its own
 *                     state behind its hooks (the learned models: next_visit, nv_victim,
 *                     affinity, neighbours, which only policy files call) and its one
 *                     registration
 *   order.c           the eviction orders behind one interface (rc_order_ops) and the one
 *                     victim loop (take_victims)
 *
 * Calls go down this list, never up (nor between policies): the access, the entry points and
 * prefetch change a key's state through state.c, which calls only the holds and the orders
 * (tests/test_c_call_layers.py reads every call and checks it).
 *
 * Adding a policy is one file in policies/ that ends with its registration
 * (RC_EVICTION_POLICY / RC_ADMISSION_POLICY / RC_PREFETCH_POLICY below, named exactly as the
 * registry names it), its Python reference class (runtime/residency/policies/) and its
 * registry line (policies/factory.py), a learned one too: its parameters come in its row of
 * c->pol, its state through its hooks (below). The build generates the tables from the files
 * present (policy_table.py); a kind is an index there, looked up by name (rc_policy_kind).
 */
#ifndef CORE_IMPL_H
#define CORE_IMPL_H
#include "residency_core.h"
#include "../../csupport/grow.h"

#include <pthread.h>
#include <stdint.h>

#define RESIDENT_MAX 2            /* states 0..2: resident, admitted in that phase */
#define ABSENT 8
#define NEVER (((int64_t) 1) << 62)

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

/* ---- the policy interface: one descriptor per policy (policies/) ------------------------- */
/* an eviction score: the lowest (score, last seq, flat) is evicted first */
typedef double (*rc_score_fn)(const rc_core *c, int32_t order, int32_t f);
/* may f (a demand miss) be admitted over victims (the order's lowest first)? */
typedef int (*rc_admit_fn)(const rc_core *c, int32_t phase, int32_t f, const int32_t *victims,
                           int32_t n_victims);

/* an eviction order implementation: the heap (order.c), or a policy's own (next-visit's
 * index, policies/evict_next_visit.c); every hook gets its order's index o (its policy's
 * state: c->order_state[o]) */
typedef struct {
    int (*push)(rc_core *c, pool *p, int32_t o, int32_t f);      /* f joins (0, -1 nomem) */
    void (*remove)(rc_core *c, pool *p, int32_t o, int32_t f);   /* f leaves (if in) */
    /* the lowest unprotected key, left in the order, or -1; protected keys met on the way
     * may wait in c->r_aside until settle() */
    int32_t (*lowest)(rc_core *c, pool *p, int32_t o, int64_t seq0);
    /* does v rank strictly below f, whose score is `own` (NAN: its own)? */
    int (*ranks_below)(const rc_core *c, int32_t o, int32_t v, int32_t f, double own);
    /* optional (NULL: nothing to do): every order empty (new pools), a layer-step's experts
     * before any is touched, holds taken or ended (order_hold), its own invariants (0 ok) */
    void (*reset)(rc_core *c, int32_t o);
    void (*visit)(rc_core *c, int32_t o, int32_t layer, const int32_t *experts, int32_t n,
                  int32_t phase);
    void (*hold)(rc_core *c, int32_t o, int32_t layer, const int32_t *experts, int32_t n,
                 int32_t delta);
    int (*verify)(const rc_core *c, int32_t o);
} rc_order_ops;
extern const rc_order_ops rc_heap_order;   /* order.c */

/* what a planner sees of the layer-step that ran */
typedef struct {
    int32_t layer, n, phase, n_missed;
    int32_t up_layer, n_up;
    const int32_t *experts, *up_experts;
    const int64_t *up_index;
    int32_t first_next;           /* index into moe_layers of the first MoE layer after it */
} rc_step_view;

/* A policy's own state (a learned model, a decayed count) is behind its descriptor's hooks,
 * in its own file: the mechanism keeps one opaque pointer per order (c->order_state[o]) and
 * per phase (c->planner_state[ph]), calls the hooks where they are due, and never names a
 * policy's model. A policy reads its parameters (its registry line's c_params, in order)
 * from its row of c->pol (order_params[o], admission_params[ph], prefetch_params[ph]). */
typedef struct {
    const char *name;             /* the registry's */
    const rc_order_ops *ops;      /* the order that ranks by the score */
    rc_score_fn score;
    int score_is_last_seq;        /* score == last seq (lru): the heap compares last seqs
                                     only, and stops at the first key touched in the call */
    int planned_scores;           /* a planner's own scores (expected layer-steps to the next
                                     use: prefetch affinity's) rank its keys in this order */
    /* optional (NULL: none): its state, made at rc_create into *state (0 ok, -1 nomem) and
     * freed at rc_free (also after a failed create; NULL is freed too); a layer-step's
     * elements once touched (at sequence numbers seq0 + i; the call's keys are out of the
     * orders then, so its scores of them may move); a profile's key frequencies */
    int (*create)(rc_core *c, int32_t o, void **state);
    void (*destroy)(void *state);
    void (*observe)(rc_core *c, void *state, int32_t layer, const int32_t *experts, int32_t n,
                    int64_t seq0);
    void (*warm_start)(void *state, const double *frequency);
} rc_eviction_policy;

typedef struct {
    const char *name;
    rc_admit_fn admit;            /* pure */
} rc_admission_policy;

typedef struct {
    const char *name;
    /* the keys to bring in, priority order, into plan (+ *mine: their own scores, or left
     * NULL); RC_OK, or an error. Pure but for its own state (c->planner_state[s->phase]).
     * NULL: no prefetch. */
    int (*plan)(rc_core *c, const rc_step_view *s, ivec *plan, const double **mine);
    /* optional (NULL: nothing to do): after the plan was brought in (its keys from
     * r_pf_flats[first_brought] on); its state, made from the first phase that names the
     * policy (the later ones share it) into *state (0 ok, -1 nomem) and freed at rc_free
     * (also after a failed create); every layer-step's elements before any is touched (0,
     * -1 nomem), a profile's pair table and token history (residency_core.h: rc_warm_start) */
    void (*after)(rc_core *c, void *state, const ivec *plan, int32_t first_brought);
    int (*create)(rc_core *c, int32_t phase, void **state);
    void (*destroy)(void *state);
    int (*observe)(void *state, int32_t layer, const int32_t *experts, int32_t n, int32_t phase);
    void (*warm_start)(void *state, const int32_t *pair, const int32_t *count,
                       const int16_t *history, int32_t n_history, int32_t history_k);
    int needs_history;            /* each phase's latest experts per layer (c->last_experts) */
    int needs_upcoming;           /* an access without the upcoming layer-step is refused */
} rc_prefetch_policy;

/* A policy file's one registration, its last statement: id is the registry's name with '-'
 * as '_', the rest the descriptor's fields, e.g.
 *     RC_EVICTION_POLICY(lru, "lru", .ops = &rc_heap_order, .score = score,
 *                        .score_is_last_seq = 1);
 * policy_table.py collects them into the tables below (generated at build time, sorted by
 * name: a C kind is an index there). */
#define RC_EVICTION_POLICY(id, name_, ...) \
    const rc_eviction_policy rc_eviction_##id = {.name = name_, __VA_ARGS__}
#define RC_ADMISSION_POLICY(id, name_, ...) \
    const rc_admission_policy rc_admission_##id = {.name = name_, __VA_ARGS__}
#define RC_PREFETCH_POLICY(id, name_, ...) \
    const rc_prefetch_policy rc_prefetch_##id = {.name = name_, __VA_ARGS__}
extern const rc_eviction_policy *const RC_EVICTION_POLICIES[];
extern const rc_admission_policy *const RC_ADMISSION_POLICIES[];
extern const rc_prefetch_policy *const RC_PREFETCH_POLICIES[];
extern const int32_t RC_N_POLICIES[3];   /* per RC_ROLE_* */

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
    int64_t *last_seq;            /* (n_flat,) never changed while the key is in the orders
                                     (they rank by it): a touched key leaves them first */
    int64_t *uses;                /* (3, n_flat) routed count per phase */
    int64_t *next_use;            /* (n_flat,) or NULL */
    void *order_state[3];         /* each order's policy's own state (its hooks'), or NULL */
    void *planner_state[3];       /* each phase's planner's own state (shared by the phases
                                     that name the same planner), or NULL */
    /* replay's prefetch log (rc_replay_prefetches): the batch and key of every prefetch
     * issued during the latest rc_replay, in issue order; pf_event_of[f]: f's entry */
    int64_t replay_batch;         /* the batch rc_replay runs, -1 outside it */
    lvec log_batch; ivec log_flat;
    int64_t *pf_event_of;         /* (n_flat,) */
    uint8_t *pinned, *pf_unused;  /* (n_flat,) pinned: prefetched, until its layer's access */
    int32_t *lease_count;         /* (n_flat,) the leases' shares of each key; its holds are
                                     lease_count + pinned, both changed only in leases.c
                                     (each change told to order_hold) */
    int64_t *seen;                /* (n_flat,) call stamp: first occurrence within a call */
    int64_t call;
    int64_t n_pf_unused;
    int64_t seq;
    int64_t next_lease;           /* the next lease id (rc_lease_id: every lease's, from 1) */
    rc_policy pol;
    /* the policies of pol's kinds, copied at rc_create (the hot path reads them here) */
    rc_eviction_policy evict[3];      /* per order */
    rc_admission_policy admit[3];     /* per phase */
    rc_prefetch_policy planner[3];    /* per phase */
    ivec *pins_by_layer;          /* (n_layer,) */
    ivec *last_experts;           /* (3 * n_layer,) each phase's latest experts per layer
                                     (a planner's needs_history), or NULL */
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

/* the order's score of f */
static inline double rc_score(const rc_core *c, int32_t o, int32_t f) {
    return c->evict[o].score(c, o, f);
}

/* ---- order.c -------------------------------------------------------------------------- */
static inline const rc_order_ops *order_ops(const rc_core *c, int32_t o) {
    return c->evict[o].ops;
}

/* an optional hook of every order of c, with c, the order's index and these arguments */
#define EACH_ORDER_HOOK(hook, ...)                                          \
    for (int32_t o_ = 0; o_ < c->pol.n_orders; o_++) {                      \
        const rc_order_ops *ops_ = order_ops(c, o_);                        \
        if (ops_->hook != NULL) ops_->hook(c, o_, ##__VA_ARGS__);           \
    }

int order_create(rc_core *c);                      /* the orders' policies' state (rc_create) */
void order_free(rc_core *c);
void order_reset(rc_core *c);                      /* every order empty (new pools) */
/* a layer-step's elements once touched (the call's keys out of the orders): each order's
 * policy's observe hook */
void order_observe(rc_core *c, int32_t layer, const int32_t *experts, int32_t n, int64_t seq0);
/* order_add (f joins every order of its pool), order_discard (f leaves them): order_heap.h */
/* each of layer's experts (n, a repeat counts again) took (delta 1) or ended (-1) one hold:
 * a lease's share or a prefetch pin, so that a key's holds are lease_count[f] + pinned[f] and
 * it is protected while they are > 0. leases.c calls it at every change, for members of an
 * order or not: an order may keep its own count (next-visit's index does; it never reads the
 * core's arrays) */
static inline void order_hold(rc_core *c, int32_t layer, const int32_t *experts, int32_t n,
                              int32_t delta) {
    EACH_ORDER_HOOK(hold, layer, experts, n, delta);   /* inline: most have no hook */
}
/* a layer-step's experts before any is touched (next-visit learns from them) */
void order_visit(rc_core *c, int32_t layer, const int32_t *experts, int32_t n, int32_t phase);
void order_warm_start(rc_core *c, const double *frequency);
int order_verify(const rc_core *c);                /* 0 ok, else rc_verify's code */
int protected_key(const rc_core *c, int32_t f, int64_t seq0);
/* does v rank strictly below f in order o by (score, last seq, flat), f's score `own` (NAN:
 * its own)? (the heap's ranks_below; an order of a policy's own may take it too) */
int order_ranks_below(const rc_core *c, int32_t o, int32_t v, int32_t f, double own);
/* The one victim loop: free `need` bytes of pool p in order o's lowest unprotected keys
 * (into c->r_victims); with `bounded`, only keys that rank strictly below f (score `own`, NAN:
 * its own). 1: they free enough, taken out of the order; 0: they do not, and stay in it. */
int take_victims(rc_core *c, pool *p, int32_t o, int64_t seq0, int64_t need, int bounded,
                 int32_t f, double own);
/* victims taken but not used go back into the order */
void untake_victims(rc_core *c, pool *p, int32_t o);

/* ---- leases.c: the holds (leases, prefetch pins; each change -> order_hold) --------------- */
int take_lease(rc_core *c, int64_t id, int32_t base, const int32_t *experts, int32_t n);
int pin_key(rc_core *c, int32_t f);                /* until its layer's access (0, -1 nomem) */
void unpin_layer(rc_core *c, int32_t layer);       /* the layer's access: its pins end */

/* ---- state.c: state changes -------------------------------------------------------------- */
/* f becomes resident, admitted in `phase`; a prefetched key is pinned until its layer's next
 * access (0, -1 nomem) */
int make_resident(rc_core *c, int32_t f, int32_t phase, int prefetched);
void evict(rc_core *c, int32_t f, int32_t phase);

/* ---- prefetch.c --------------------------------------------------------------------------- */
int prefetch_create(rc_core *c);                   /* each planner's own state (rc_create) */
void prefetch_free(rc_core *c);
/* every layer-step's elements, before any is touched: each planner's observe hook (0, -1) */
int prefetch_observe(rc_core *c, int32_t layer, const int32_t *experts, int32_t n,
                     int32_t phase);
void prefetch_warm_start(rc_core *c, const int32_t *pair, const int32_t *count,
                         const int16_t *history, int32_t n_history, int32_t history_k);
int run_prefetch(rc_core *c, const rc_step_view *s, int64_t seq0);
int prefetch_flats(rc_core *c, const int32_t *flats, int32_t n, int32_t phase, int64_t seq0,
                   const double *mine);

/* ---- the unlocked bodies of the entry points (api.c locks) ---------------------------------- */
int core_set_pools(rc_core *c, int32_t n_pool, const int32_t *pool_of_layer,
                   const int64_t *capacity);               /* lifetime.c */
int core_set_capacity(rc_core *c, int32_t pool, int64_t capacity);
void core_release(rc_core *c, int64_t lease_id);          /* leases.c */
int core_access(rc_core *c, int32_t layer, const int32_t *el, int32_t n, int32_t phase,
                const int64_t *next_use, int32_t up_layer, const int32_t *up_experts,
                const int64_t *up_index, int32_t n_up, int64_t lease_id, int64_t release_id,
                rc_result *out);                     /* residency_core.c */
int core_replay(rc_core *c, int64_t n_batches, const int64_t *starts, const int32_t *layers,
                const int8_t *phases, const int32_t *experts, const int64_t *next_use,
                int32_t with_upcoming, int8_t *miss_kind, int64_t *pf_event);
int core_prefetch(rc_core *c, const int32_t *flats, int32_t n, int32_t phase,
                  rc_result *out);                  /* prefetch.c */
int core_forget(rc_core *c, int32_t f);            /* state.c */
int core_pin_static(rc_core *c, const int32_t *flats, int32_t n);
int core_verify(const rc_core *c);                 /* verify.c */
void result_reset(rc_core *c);                     /* state.c: a call's results */
void result_out(rc_core *c, rc_result *out);

#endif
