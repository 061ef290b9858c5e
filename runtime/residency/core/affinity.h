/* affinity: the model behind prefetch `affinity` (internal to the residency core).
 *
 * Learned online from decode routing alone: for consecutive MoE layers (index i, i + 1) of
 * the same token, pair[i][e][e'] counts tokens routed to e at i and e' at i + 1, count[i][e]
 * the tokens routed to e at i whose next layer was seen. After a decode layer-step of layer
 * i routed to the distinct set S, the prediction for layer i + 1 is
 *     q(e') = (1 / |S'|) * sum over e in S' of pair[i][e][e'] / count[i][e]
 * (S' the experts of S with count > 0; no plan when S' is empty)
 * and the plan is the top_n experts by q (ties: lower id) with q >= min_precision.
 * Precision is measured on every plan, issued or not, at the next layer's visit (decayed
 * tallies, AF_DECAY per plan); the plan is issued only while the measured precision is at
 * least min_precision (or fewer than AF_WARMUP predictions were scored), and at most what
 * can arrive before layer i + 1 runs: link_bytes (what the link carries in one layer-step's
 * compute) per plan, spent by each prefetch of an absent key (given back if it is not
 * issued); an expert larger than link_bytes is never prefetched.
 * Operations are in the order of the Python reference (runtime/residency/reference_affinity.py).
 */
#ifndef AFFINITY_H
#define AFFINITY_H
#include <stdint.h>

typedef struct {
    int32_t n_layer, n_expert, n_moe;
    int32_t *moe_index;           /* (n_layer,) position among the MoE layers, -1 dense */
    int32_t *moe_layers;          /* (n_moe,) */
    int32_t *pair;                /* ((n_moe - 1) * E * E,) */
    int32_t *count;               /* ((n_moe - 1) * E,) */
    int32_t *prev;                /* (E,) distinct experts of the previous decode layer-step */
    int32_t n_prev, prev_layer;   /* prev_layer -1: none (or not a decode step) */
    int32_t *pred;                /* (E,) the latest plan's experts (of pred_layer) */
    int32_t n_pred, pred_layer;
    uint8_t *mark;                /* (E,) scratch */
    double *q;                    /* (E,) scratch */
    double hits, scored;          /* decayed precision tallies */
    double credit;                /* link bytes available for prefetch */
    double top_n, min_precision, link_bytes;
} af_model;

af_model *af_create(int32_t n_layer, int32_t n_expert, const int32_t *moe_layers, int32_t n_moe,
                    double top_n, double min_precision, double link_bytes);
void af_free(af_model *m);
/* a layer-step (every phase): scores the latest plan, learns pairs in decode */
void af_observe(af_model *m, int32_t layer, const int32_t *el, int32_t n, int32_t phase);
/* the plan after a decode layer-step of `layer`: flat keys into out (capacity n_expert),
 * their q into out_q; returns how many (0 when gated); `absent[f]` says which keys need a
 * transfer (only those spend credit) */
int32_t af_plan(af_model *m, int32_t layer, const uint8_t *state, uint8_t absent_state,
                const int64_t *bytes_flat, int32_t *out, double *out_q);
/* add a routing profile's table: pair ((n_moe - 1) * E * E,), count ((n_moe - 1) * E,) */
void af_warm_start(af_model *m, const int32_t *pair, const int32_t *count);
/* give back the credit of planned prefetches that were not issued */
void af_refund(af_model *m, double bytes);

#endif
