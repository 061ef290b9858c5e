/* next_visit: the model behind eviction `next-visit` (internal to the residency core).
 *
 * For each expert, p = the probability that it is routed at the next visit of its layer,
 * from a logistic model over NV_F features, learned online:
 *   x = (1, 1/age, h_fast, h_mid, h_slow)
 *   age    visits of its layer from its last routed use to the next visit (0 feature: never)
 *   h_k    EMAs of "routed at a visit of its layer", rates NV_RATES (h = (1 - a) h + a y);
 *          y = the key's routings in the visit / the most routed key's (one token: 0 or 1; a
 *          prefill chunk grades its experts by use)
 * At every decode (or mixed) visit of a layer, every 8th expert of that layer (in rotation:
 * experts e with e % 8 == decode layer-steps so far % 8) is one sample
 * (features before the visit, label routed or not); the gradient sum is applied once every
 * n_moe such visits (w += learning_rate * g), so the model changes once per token's worth of
 * layer-steps. The expected time to its next use, in layer-steps, is
 *   dist(layer, current layer) + n_moe * (1 / p - 1) = dist + n_moe * exp(-w . x)
 * with dist in 1..n_moe (the current layer itself is n_moe away). Eviction `next-visit`
 * takes the largest first. Every operation is written in the order the Python reference
 * (runtime/residency/reference_next_visit.py) performs it, so both give the same doubles.
 */
#ifndef NEXT_VISIT_H
#define NEXT_VISIT_H
#include <stdint.h>

#define NV_F 5

typedef struct {
    int32_t n_layer, n_expert, n_moe;
    int32_t *moe_index;           /* (n_layer,) position among the MoE layers, -1 dense */
    int64_t *vis;                 /* (n_layer,) visits (access calls) of each layer so far */
    int64_t *last_vis;            /* (n_flat,) vis of its layer at its last routed use; 0 never */
    double *h;                    /* (3, n_flat) */
    uint8_t *mark;                /* (n_expert,) scratch: routed in this visit */
    int32_t *cnt;                 /* (n_expert,) scratch: routings in this visit */
    double w[NV_F], g[NV_F];
    double learning_rate;
    int64_t steps, version;       /* decode visits; weight updates */
    int32_t cur;                  /* the layer of the latest visit, -1 before any */
    double *e_cache;              /* (n_flat,) exp(-w . x), valid for (version, vis of layer) */
    int64_t *e_version, *e_vis;
} nv_model;

nv_model *nv_create(int32_t n_layer, int32_t n_expert, const int32_t *moe_layers, int32_t n_moe,
                    double learning_rate);
void nv_free(nv_model *m);
/* one visit of `layer` with the routed experts el[n]; learns when phase != prefill */
void nv_visit(nv_model *m, int32_t layer, const int32_t *el, int32_t n, int32_t phase);
/* frequency (n_flat,): every h_k of every key (a routing profile's decode shares) */
void nv_warm_start(nv_model *m, const double *frequency);
/* expected layer-steps until flat's next use, seen from the latest visit */
double nv_expected(nv_model *m, int32_t flat);

#endif
