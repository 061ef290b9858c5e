/* nv_victim: eviction next-visit's victim search (internal to the residency core).
 *
 * The rule (next_visit.h): a layer's candidate is its lowest unprotected (z, last seq, flat),
 * found with no exp; the victim is the candidate lowest in (-expected, z, last seq, flat),
 * expected = distance + n_moe wait, with z, the rolled wait and the distance from the model.
 * Protected: touched at or after the call's first sequence number (seq0), leased or pinned.
 *
 * The index owns what it reads: it never points into the core. Its copies, and who keeps
 * them true (rc_verify's check 12 compares them with the core's arrays):
 *   - each member's last seq, given when the key joins the order (nvv_push). The core never
 *     changes a key's last seq while it is in the orders: a touched key leaves them first and
 *     rejoins at its new seq (residency_core.c), a prefetch touches only absent keys;
 *   - each key's holds (its leases' shares and its prefetch pin: protected while any), which
 *     the core tells it as each is taken or ended (nvv_hold);
 *   - the MoE layers (n_moe,), copied at creation.
 * The model (nv_model, next_visit.h) is the order's own, shared with nv_visit; visits and
 * weight updates reach the index through the model's counters (vis, version).
 *
 * Kept between calls, so a call costs O(layers) plus the layers that changed:
 *   - per layer, a list: a prefix of its keys in (z, last seq, flat), at most NV_LIST long
 *     (list_all: every key), and list_bound <= the z of every key not listed; keys join and
 *     leave it in place. A visit of the layer moves its keys' features: the list is refilled
 *     on its next use (every member scored; the NV_LIST least found with no branches). A
 *     weight update moves every z by dw . x, which the features' box bounds: the listed keys
 *     are rescored and those still strictly below the bound's new value stay, in order
 *     (resort_list), so a weight update costs each layer its listed keys, not all of them;
 *   - per layer, its candidate with z and n_moe wait, until marked dirty: a key of the
 *     layer joined or left the order, one of its holds was taken or ended, it was visited,
 *     the model's weights moved (once per token's worth of layer-steps), or a key skipped
 *     for being touched at or after seq0 may no longer be (seq0 moved). The wait is first
 *     only bounded, with no exp (nv_wait_bounds: about 1e-5 apart); the search computes it
 *     (nv_wait, four exp) only for a candidate whose bounds do not yet set it apart from
 *     every other's: most candidates are never the victim, and the victim is most often
 *     apart from the rest by more than its bounds' width;
 *   - every layer's -expected (its bounds), recomputed when the model's current layer moves.
 * nvv_verify checks the lists' invariants, the candidates' bounds and the copies (rc_verify's
 * checks 11 and 12); every decision is the reference's (runtime/residency/reference.py sorts
 * every key; tests compare).
 * The core keeps the order's membership (its heap, with no order) and tells this search every
 * change through the functions below (its order, in policies/evict_next_visit.c).
 */
#ifndef NV_VICTIM_H
#define NV_VICTIM_H
#include <stdint.h>

#include "next_visit.h"

#define NV_LIST 8       /* each layer's lowest keys kept between calls */

typedef struct {
    nv_model *nv;
    int32_t n_layer, n_expert, n_moe, n_words;
    int32_t *moe_layers;          /* (n_moe,) a copy */
    int64_t *last_seq;            /* (n_flat,) each member's, given at nvv_push (others: stale) */
    int32_t *holds;               /* (n_flat,) its leases' shares + its pin, every key
                                     (nvv_hold): protected while > 0 */
    uint64_t *members;            /* (n_layer, n_words) bitmap: the layer's keys in the order */
    int32_t *ids, *sel; double *zs;  /* (n_expert,) scratch: a layer's members, their z */
    uint8_t *in_list;             /* (n_flat,) the key is in its layer's list */
    int32_t *list, *list_n;       /* (n_layer, NV_LIST), (n_layer,) */
    uint8_t *list_all;            /* (n_layer,) the list holds every key of the layer */
    int64_t *list_vis, *list_ver; /* (n_layer,) the layer's visits and the model's version the
                                     list's order is for; list_vis -1: invalid */
    double *list_bound;           /* (n_layer,) every member not listed has z >= this (+inf) */
    double *list_w;               /* (n_layer, NV_F) the weights list_bound is for */
    int64_t version;              /* the model's version the candidates are for */
    /* per MoE index k: the candidate (-1: none), its scores below, pool */
    int32_t *cand, *pool;
    double *cand_z;               /* z */
    double *cand_le, *cand_lo;    /* n_moe wait's upper and lower bound (equal once exact;
                                     -inf: none) */
    double *cand_s;               /* -expected's lower bound, -(distance + le) (+inf: none;
                                     the upper: -(distance + lo)) */
    double *masked;               /* (n_moe,) scratch: cand_s, +inf outside the pool */
    uint8_t *exact;               /* (n_moe,) the candidate's wait is nv_wait's, not bounds */
    uint8_t *dirty, *dep;         /* (n_moe,) dep: a key was skipped for last seq >= seq0 */
    int32_t *dirty_list, n_dirty, n_dep;
    int64_t seq0;                 /* of the latest search */
    int32_t s_cur;                /* the model's current layer cand_s was computed for */
    int32_t one_pool;             /* every MoE layer is in the same pool */
} nv_victim;

nv_victim *nvv_create(nv_model *nv, int32_t n_layer, int32_t n_expert,
                      const int32_t *moe_layers, int32_t n_moe);
void nvv_free(nv_victim *s);
/* the orders are empty again; pool_of_layer (n_layer,) the pools */
void nvv_reset(nv_victim *s, const int32_t *pool_of_layer);
/* the layer's members (n_words words): bit e set for each of its keys in the order */
static inline const uint64_t *nvv_members(const nv_victim *s, int32_t layer) {
    return &s->members[layer * s->n_words];
}
/* flat joined the order, last accessed at sequence number last_seq (which stays its own until
 * it leaves) / left the order */
void nvv_push(nv_victim *s, int32_t flat, int64_t last_seq);
void nvv_remove(nv_victim *s, int32_t flat);
/* each of layer's experts (n, a repeat counts again) took (delta 1) or ended (-1) one hold
 * (a lease's share, a prefetch pin) */
void nvv_hold(nv_victim *s, int32_t layer, const int32_t *experts, int32_t n, int32_t delta);
/* the layer was visited (its keys' z moved) */
void nvv_stale(nv_victim *s, int32_t layer);
/* every key's z changed (a warm start) */
void nvv_stale_all(nv_victim *s);
/* the lowest unprotected key of pool in the order, or -1 (it stays in the order) */
int32_t nvv_lowest(nv_victim *s, int32_t pool, int64_t seq0);
/* the index's invariants (nv_victim.c): 0 ok, else which check failed: 1..8 the lists and
 * the candidates; 9 a key's holds, 10 a member's last seq are not the core's (its arrays,
 * (n_flat,) each, only read here) */
int nvv_verify(const nv_victim *s, const int64_t *last_seq, const int32_t *lease_count,
               const uint8_t *pinned);

#endif
