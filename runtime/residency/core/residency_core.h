/* residency_core: every per-access residency decision of one device, in C.
 *
 * One rc_core is one device of the ExpertResidencyManager (runtime/residency/manager.py):
 * which experts are resident, their bytes per pool, the eviction orders, leases, prefetch
 * pins, usage statistics and the per-(pool, phase) counters. A decision takes effect at once:
 * an admitted expert is resident from its admission on (the caller then moves its bytes; a
 * copy that fails calls rc_forget). The Python reference of the same rules is
 * runtime/residency/reference.py; tests run both on the same streams and compare every
 * decision. Keys are flat ints: flat = layer * n_expert + expert. The parts (eviction orders,
 * admission rules, prefetch planners) are private: core/core_impl.h.
 *
 * Locking: every function below takes the core's mutex for its whole call (queries too), so
 * any thread may call any of them (the routing hook calls rc_access from the graph thread
 * while Python reads rc_pool_snapshot); what a call returns is one consistent state. The
 * arrays an rc_result points into belong to the core and stay valid only until the next call
 * on it: read them before another thread may call it (the manager holds its own lock around
 * both). rc_create and rc_free are the exceptions: nothing else may use the core meanwhile.
 *
 * Usage (a whole C function body: tests/runtime/residency/test_core_build.py compiles and
 * runs it):
 *
 *     int64_t expert_bytes[2] = {0, 3 << 20};         // layer 0 dense, layer 1 MoE
 *     rc_policy policy = {.n_orders = 1};              // one order for every phase:
 *     policy.order_kind[0] = rc_policy_kind(RC_ROLE_EVICTION, "lru");
 *     for (int ph = 0; ph < 3; ph++) {                 // always admit, no prefetch
 *         policy.admission[ph] = rc_policy_kind(RC_ROLE_ADMISSION, "always");
 *         policy.prefetch[ph] = rc_policy_kind(RC_ROLE_PREFETCH, "none");
 *     }
 *     rc_core *c = rc_create(2, 128, expert_bytes, &policy);
 *     int32_t pool_of_layer[2] = {-1, 0};
 *     int64_t capacity[1] = {64 << 20};                // bytes
 *     rc_set_pools(c, 1, pool_of_layer, capacity);
 *     int32_t experts[4] = {5, 17, 3, 90};             // one layer-step, routing order
 *     rc_result r;
 *     int64_t lease = rc_lease_id(c);                  // the core mints every lease id
 *     int rc = rc_access(c, 1, experts, 4, RC_DECODE, NULL, -1, NULL, NULL, 0,
 *                        lease, 0, &r);                // the lease holds them, none released
 *     int admitted = r.n_admitted;                     // read r before the next call
 *     rc_release(c, lease);                            // the layer's experts ran
 *     rc_pool_stats stats;
 *     rc_pool_snapshot(c, 0, &stats);
 *     rc_free(c);
 *     return rc == RC_OK && admitted == 4 && stats.resident_count == 4 ? 0 : 1;
 */
#ifndef RESIDENCY_CORE_H
#define RESIDENCY_CORE_H
#include <stdint.h>

#define RC_N_COUNTERS 14
/* counter order (telemetry.PhaseCounters, without the derived hits): accesses misses demand_miss_bytes admissions admitted_bytes
 * transient_uses transient_bytes evictions evicted_bytes prefetch_issued
 * prefetch_issued_bytes prefetch_used_bytes prefetch_wasted_bytes transition_hits */

typedef struct rc_core rc_core;

/* policies: one eviction order per distinct eviction spec; per phase an order index, an
 * admission and a prefetch policy (kind + parameters). A kind is a policy's index in its
 * role's table, which the build generates from the policy files present (core/policies/,
 * sorted by name): look kinds up by name (rc_policy_kind), never write their numbers. */
enum { RC_ROLE_EVICTION = 0, RC_ROLE_ADMISSION = 1, RC_ROLE_PREFETCH = 2 };
/* the kind of the policy `name` (the registry's, runtime/residency/policies/factory.py) in
 * `role`, or -1: none of that name */
int32_t rc_policy_kind(int32_t role, const char *name);
/* the name of kind `kind` in `role`, or NULL past the last (kinds count from 0) */
const char *rc_policy_name(int32_t role, int32_t kind);

/* the most parameters one policy takes (rc_policy's rows; the registry's c_params give them) */
enum { RC_MAX_PARAMS = 8 };

typedef struct {
    int32_t n_orders;             /* 1..3 */
    int32_t order_kind[3];        /* eviction kinds */
    int32_t phase_order[3];       /* phase -> order index */
    int32_t admission[3];         /* admission kinds */
    int32_t prefetch[3];          /* prefetch kinds */
    /* each policy's own parameters, in the order its registry line gives them (c_params;
     * the rest 0): what they mean is its file's business (its parameter block), never the
     * mechanism's. Rows of RC_MAX_PARAMS (8). */
    double order_params[3][8];    /* per order */
    double admission_params[3][8];   /* per phase */
    double prefetch_params[3][8];    /* per phase */
    int32_t n_expert_used;        /* experts per token: prompt chunks' rows are token-major,
                                     n_expert_used each (affinity learns from them); 0 unknown */
    int32_t track_next_use;       /* an offline policy: access() needs next_use */
} rc_policy;

enum { RC_PREFILL = 0, RC_DECODE = 1, RC_MIXED = 2 };   /* phases */

typedef struct {
    int32_t hits, misses, transition_hits;
    int64_t demand_miss_bytes;
    int32_t n_admitted, n_evicted, n_transient;
    const int32_t *admitted;      /* flat keys, routing order: resident now */
    const int32_t *evicted;       /* flat keys: their victims, gone now */
    const int32_t *transient;     /* flat keys */
    int32_t n_prefetched;         /* prefetches issued (resident now) */
    const int32_t *prefetched;    /* their flat keys */
    const int32_t *prefetch_n_victims;
    const int32_t *prefetch_victims;  /* concatenated, prefetch order */
    int64_t bad_value;            /* the offending id on RC_ERR_EXPERT / RC_ERR_LAYER */
} rc_result;

enum {
    RC_OK = 0, RC_ERR_LAYER = -1, RC_ERR_EXPERT = -2, RC_ERR_NEXT_USE = -3,
    RC_ERR_UPCOMING = -4, RC_ERR_NEXT_USE_LEN = -5, RC_ERR_POOL = -6, RC_ERR_CHARGED = -7,
    RC_ERR_STATE = -9, RC_ERR_NOMEM = -10,
};

rc_core *rc_create(int32_t n_layer, int32_t n_expert, const int64_t *expert_bytes,
                   const rc_policy *policy);
void rc_free(rc_core *c);

/* pools: pool_of_layer[n_layer] (-1 for dense layers), capacity per pool (-1 unresolved).
 * Only while nothing is resident or leased. */
int rc_set_pools(rc_core *c, int32_t n_pool, const int32_t *pool_of_layer,
                 const int64_t *capacity);
/* one pool's capacity: refused below its resident bytes */
int rc_set_capacity(rc_core *c, int32_t pool, int64_t capacity);

/* one layer-step: experts[n] in routing order; next_use[n] or NULL; upcoming (the next
 * layer-step, belady prefetch) as up_layer / up_experts[n_up] / up_index[n_up] or
 * up_layer -1. lease_id > 0 (from rc_lease_id) leases the call's experts until
 * rc_release(lease_id); release_id > 0 ends that lease first. */
int rc_access(rc_core *c, int32_t layer, const int32_t *experts, int32_t n, int32_t phase,
              const int64_t *next_use, int32_t up_layer, const int32_t *up_experts,
              const int64_t *up_index, int32_t n_up, int64_t lease_id, int64_t release_id,
              rc_result *out);
void rc_release(rc_core *c, int64_t lease_id);

/* replay: n_batches layer-steps over rows experts[starts[b] .. starts[b+1]) with no leases;
 * miss_kind[row] (n rows) gets 1 admitted, 2 transient for the first row of each missed key,
 * 4 the first use (a hit) of a prefetched key, else 0;
 * pf_event[row] (n rows, or NULL) gets, at the rows of kind 4, the index of that prefetch in
 * the replay's prefetch log (rc_replay_prefetches; other rows are left as they are).
 * next_use (n rows) or NULL; upcoming: the next batch (belady prefetch) when with_upcoming.
 * Stops at the first error (its code). */
int rc_replay(rc_core *c, int64_t n_batches, const int64_t *starts, const int32_t *layers,
              const int8_t *phases, const int32_t *experts, const int64_t *next_use,
              int32_t with_upcoming, int8_t *miss_kind, int64_t *pf_event);
/* the latest rc_replay's prefetches in issue order: batch[i] issued flat[i]; returns their
 * number (the arrays stay valid until the next rc_replay or rc_free) */
int64_t rc_replay_prefetches(rc_core *c, const int64_t **batch, const int32_t **flat);

/* the step (step.c): one consumer's layer-step, as every live consumer (the routing hook's
 * bookkeeping, the device cache, the RAM tier) takes it. rc_step leases the layer's experts
 * under a lease id the core mints and ends the consumer's previous lease (*held, 0: none) in
 * the same call; *held becomes the new lease (0 on an error). rc_step_end ends *held (the
 * batch's end). rc_step_message formats a refusal: "<who>the residency core refused layer L
 * (status S)".
 *
 *     int64_t held = 0;
 *     for each MoE layer-step: if (rc_step(c, &held, layer, experts, n, phase, &r)) fail;
 *     rc_step_end(c, &held);
 */
int rc_step(rc_core *c, int64_t *held, int32_t layer, const int32_t *experts, int32_t n,
            int32_t phase, rc_result *out);
void rc_step_end(rc_core *c, int64_t *held);
void rc_step_message(char *buf, int32_t cap, const char *who, int32_t layer, int status);
/* a fresh lease id. The core is the one owner of its lease ids (1, 2, ...): rc_step mints its
 * own, and a caller of rc_access that leases (the manager, through its device's core) takes
 * its id here, so no two holders ever share one. A consumer that steps needs nothing but
 * rc_step / rc_step_end. */
int64_t rc_lease_id(rc_core *c);

/* the live consumers' calling pattern, for benchmarks (step.c, beside rc_step): n_steps
 * layer-steps (layers[i], experts[i * k, (i + 1) * k)) through rc_step, then rc_step_end;
 * returns the hits */
int64_t rc_bench_live(rc_core *c, int64_t n_steps, const int32_t *layers, const int32_t *experts,
                      int32_t k, int32_t phase);

/* offline: for each of n accesses to flat keys (0 <= key < n_keys), the index of the next
 * access to the same key, or `never` */
void rc_next_use(const int64_t *keys, int64_t n, int64_t n_keys, int64_t never, int64_t *out);

/* warm start from a routing profile (runtime/residency/profile.py): frequency (n_flat,) the
 * share of decode tokens routed to each key seeds next-visit's frequency estimates (every
 * time scale); pair ((n_moe - 1) * E * E,) and count ((n_moe - 1) * E,) seed affinity's
 * table (added to it); history (n_history, n_moe, history_k) the last decode tokens' distinct
 * experts at each MoE layer in routing order (-1 pad) join affinity's token-neighbour history
 * (neighbours.h), oldest first. NULL (or n_history 0): leave that part; a policy without the
 * model ignores it. */
int rc_warm_start(rc_core *c, const double *frequency, const int32_t *pair, const int32_t *count,
                  const int16_t *history, int32_t n_history, int32_t history_k);

/* prefetch keys (flat) in priority order; out->prefetched lists those brought in (resident
 * now), out->prefetch_victims their victims (evicted now) */
int rc_prefetch(rc_core *c, const int32_t *flats, int32_t n, int32_t phase, rc_result *out);

/* a resident key leaves (the mechanism lost it: a failed copy); counts nothing */
int rc_forget(rc_core *c, int32_t flat);

/* static devices: pin keys for good (resident, never evicted); the device turns static */
int rc_pin_static(rc_core *c, const int32_t *flats, int32_t n);

/* one pool at one instant: occupancy and its (phase, counter) counters */
typedef struct {
    int64_t capacity;             /* bytes; -1 unresolved */
    int64_t resident_bytes, resident_count;
    int64_t counters[3][14];      /* [phase][counter]: RC_N_COUNTERS, the order above */
} rc_pool_stats;

/* queries (each a consistent state: taken under the mutex) */
int rc_pool_snapshot(rc_core *c, int32_t pool, rc_pool_stats *out);   /* RC_ERR_POOL */
int32_t rc_state(rc_core *c, int32_t flat);                  /* 0..2 resident (the admitting
                                                                phase), 8 absent, -1 no key */
void rc_copy_states(rc_core *c, uint8_t *out);               /* (n_flat,) rc_state of each */
void rc_copy_uses(rc_core *c, int64_t *out);                 /* (3, n_flat): accesses per
                                                                phase and key */
int32_t rc_n_pool(rc_core *c);
int32_t rc_pool_of_layer(rc_core *c, int32_t layer);
int32_t rc_n_leases(rc_core *c);
int rc_verify(rc_core *c);                                   /* 0 ok, else which check
                                                                (core/verify.c) */

#endif
