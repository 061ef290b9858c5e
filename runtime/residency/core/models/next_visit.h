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
 * experts e with e % 8 == decode layer-steps so far % 8) that is resident before the visit
 * (in the eviction order: the keys the model ranks) is one sample (features before the
 * visit, label routed or not, p from the layer's weights below). Learning where the
 * decisions are made: a sample of every expert is mostly cold keys that are never
 * candidates (on the two real traces, geometric mean over 10/20/30 % of the expert bytes
 * 1.951x -> 1.937x forced-admission Belady, lower in every cell); the
 * gradient sum is applied once every n_moe such visits (w += learning_rate * g), so the model
 * changes once per token's worth of layer-steps. With z = w . x and p = 1 / (1 + exp(-z)),
 * the expected time to its next use, in layer-steps, is
 *   dist(layer, current layer) + n_moe * wait
 * with dist in 1..n_moe (the current layer itself is n_moe away) and wait the expected visits
 * of its layer after the next one before it is routed again. p is not the same at every
 * later visit: while the key is not routed its features decay (h_k *= 1 - a_k a visit, age
 * grows), so wait rolls the hazard forward (nv_roll): p_n at visits n = 0 (the next), 4 and
 * 35, each standing for its block of visits [0, 1), [1, 8), [8, 64), and p_64 from visit 64
 * on; wait = sum over n >= 1 of the survival prod_{m < n} (1 - p_m). With p the same at
 * every visit that is 1 / p - 1 = exp(-z) (as it was before the roll: geometric mean over
 * the 6 cells of the two real traces 1.937x -> 1.925x forced-admission Belady; 3 points
 * 1.928x, 5 points 1.926x).
 * Eviction `next-visit` takes each layer's lowest (z, last seq, flat) as its candidate
 * (found with no exp, nv_victim.c; it is the layer's lowest p at the next visit) and of the
 * candidates the largest expected time, ties by the lower z, then (last seq, flat). The
 * search needs the wait itself (nv_wait: 4 exp) only where the candidates' bounds on it do
 * not already set the victim apart (nv_wait_bounds: the roll with a polynomial exp, no exp,
 * about 1e-5 apart; bench_manager's stream: 131 such in 101,693 searches).
 * (Ranking each layer's keys by the rolled wait too: a score that is not monotone in z,
 * which the per-layer lists rely on, and 5 exp per key a visit; the candidates' wait alone
 * took most of its gain in a scratch simulation: 1.9251x against 1.9221x.) The learning
 * still fits p at the next visit only.
 * Every operation is written in the order the Python reference
 * (runtime/residency/reference/next_visit.py) performs it, so both give the same doubles.
 */
#ifndef NEXT_VISIT_H
#define NEXT_VISIT_H
#include <math.h>
#include <stdint.h>

#define NV_F 5
#define NV_INV_N 1024   /* 1 / age from a table below this age (the same doubles) */
#define NV_ROLL 4       /* the visits the rolled wait evaluates p at (next_visit.c) */

typedef struct {
    int32_t n_layer, n_expert, n_moe;
    int32_t *moe_index;           /* (n_layer,) position among the MoE layers, -1 dense */
    int64_t *vis;                 /* (n_layer,) visits (access calls) of each layer so far */
    int64_t *last_vis;            /* (n_flat,) vis of its layer at its last routed use; 0 never */
    double *h;                    /* (3, n_flat) */
    uint8_t *mark;                /* (n_expert,) scratch: routed in this visit */
    int32_t *cnt;                 /* (n_expert,) scratch: routings in this visit */
    double *y;                    /* (n_expert,) scratch: this visit's labels, 0 between visits */
    double inv[NV_INV_N];         /* inv[k] = 1.0 / k, inv[0] = 0 */
    double w[NV_F], g[NV_F];
    double learning_rate;
    int64_t steps;                /* decode visits */
    int32_t cur;                  /* the layer of the latest visit, -1 before any */
    double *z_cache, *wait_cache; /* (n_flat,) w . x and the rolled wait (>= 0; < 0: only
                                     nv_wait_bounds' estimate, negated; NAN: neither yet),
                                     valid while e_stamp == nv_stamp of its layer (-1: stale) */
    int64_t *e_stamp;
    int64_t version;              /* weight updates and warm starts so far */
    double h_lo, h_hi;            /* every h is in [h_lo, h_hi] (0, 1; a warm start widens) */
    double decay[NV_ROLL][3];     /* (1 - a_k)^n at the roll's visits */
} nv_model;

nv_model *nv_create(int32_t n_layer, int32_t n_expert, const int32_t *moe_layers, int32_t n_moe,
                    double learning_rate);
void nv_free(nv_model *m);
/* one visit of `layer` with the routed experts el[n]; learns when phase != prefill, from
 * the layer's eviction candidates: bit e of candidates (ceil(n_expert / 64) words) set for a
 * resident expert e (the keys in the eviction order before the visit) */
void nv_visit(nv_model *m, int32_t layer, const int32_t *el, int32_t n, int32_t phase,
              const uint64_t *candidates);
/* frequency (n_flat,): every h_k of every key (a routing profile's decode shares) */
void nv_warm_start(nv_model *m, const double *frequency);
/* the rolled wait of flat of `layer` (next_visit.c; nv_wait caches it) */
double nv_roll(const nv_model *m, int32_t layer, int32_t flat);
/* lo <= nv_wait <= hi of flat of `layer` with no exp (the roll with exp within 1e-8: about
 * 1e-5 apart): 1 when lo == hi == nv_wait (known already, or outside the bounds' range:
 * then computed), 0 when they are bounds only (next_visit.c) */
int nv_wait_bounds(nv_model *m, int32_t layer, int32_t flat, double *lo, double *hi);
/* x (NV_F,) of flat f of `layer` for its next visit */
static inline void nv_features(const nv_model *m, int32_t layer, int32_t f, double *x) {
    const int32_t n = m->n_layer * m->n_expert;
    x[0] = 1.0;
    const int64_t age = m->vis[layer] + 1 - m->last_vis[f];
    x[1] = m->last_vis[f] <= 0 ? 0.0 : age < NV_INV_N ? m->inv[age] : 1.0 / (double) age;
    x[2] = m->h[f];
    x[3] = m->h[n + f];
    x[4] = m->h[2 * n + f];
}

static inline double nv_dot(const double *w, const double *x) {
    double z = w[0] * x[0];
#pragma GCC unroll 8
    for (int32_t j = 1; j < NV_F; j++) z = z + w[j] * x[j];
    return z;
}

/* what a layer's scores depend on: its visits and the model's version, as one number
 * (unsigned arithmetic: it wraps, never overflows; visits and versions both only grow) */
static inline int64_t nv_stamp(const nv_model *m, int32_t layer) {
    return (int64_t) ((uint64_t) m->vis[layer] + ((uint64_t) m->version << 40));
}

/* the slow path of nv_logit: recompute flat's z from its features */
static inline void nv_refresh(nv_model *m, int32_t layer, int32_t f) {
    double x[NV_F];
    nv_features(m, layer, f, x);
    m->z_cache[f] = nv_dot(m->w, x);
    m->wait_cache[f] = NAN;
    m->e_stamp[f] = nv_stamp(m, layer);
}

/* z = w . x of flat's features for its layer's next visit (p = 1 / (1 + exp(-z))); flat is
 * a key of `layer` */
static inline double nv_logit(nv_model *m, int32_t layer, int32_t flat) {
    if (m->e_stamp[flat] != nv_stamp(m, layer)) nv_refresh(m, layer, flat);
    return m->z_cache[flat];
}

/* expected visits of its layer after the next one until flat is routed again (the rolled
 * hazard: the header) */
static inline double nv_wait(nv_model *m, int32_t layer, int32_t flat) {
    (void) nv_logit(m, layer, flat);              /* (the stamp) */
    if (!(m->wait_cache[flat] >= 0.0)) m->wait_cache[flat] = nv_roll(m, layer, flat);
    return m->wait_cache[flat];
}

/* layer's distance in the cycle from the latest visit, 1..n_moe */
static inline double nv_distance(const nv_model *m, int32_t layer) {
    const int32_t L = m->n_moe;
    const int32_t cur = m->cur >= 0 ? m->moe_index[m->cur] : -1;
    int32_t d = m->moe_index[layer] - cur;       /* 1..L: ((index - cur - 1) mod L) + 1 */
    if (d <= 0) d += L;
    return (double) d;
}

/* expected layer-steps until flat's next use, seen from the latest visit */
static inline double nv_expected(nv_model *m, int32_t flat) {
    const int32_t layer = flat / m->n_expert;
    return nv_distance(m, layer) + (double) m->n_moe * nv_wait(m, layer, flat);
}

#endif
