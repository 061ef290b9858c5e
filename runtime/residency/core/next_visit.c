/* next_visit: see next_visit.h. */
#include "next_visit.h"

#include <math.h>
#include <stdlib.h>

#define NV_STRIDE 8     /* learn from one expert in NV_STRIDE per layer-step */

static const double NV_RATES[3] = {0.5, 0.125, 0.03125};
static const double NV_W0[NV_F] = {-3.0, 2.0, 1.0, 2.0, 3.0};   /* p ~ 0.05 for an unseen key */
/* the rolled wait's visits after the next one (0: the next), each standing for the block of
 * visits from it to the next's start (at its middle), the last for every visit from it on */
static const int32_t NV_ROLL_AT[NV_ROLL] = {0, 4, 35, 64};
static const int32_t NV_ROLL_LEN[NV_ROLL - 1] = {1, 7, 56};

nv_model *nv_create(int32_t n_layer, int32_t n_expert, const int32_t *moe_layers, int32_t n_moe,
                    double learning_rate) {
    nv_model *m = calloc(1, sizeof *m);
    if (m == NULL) return NULL;
    const int32_t n = n_layer * n_expert;
    m->n_layer = n_layer; m->n_expert = n_expert; m->n_moe = n_moe;
    m->learning_rate = learning_rate;
    m->cur = -1;
    m->h_lo = 0.0; m->h_hi = 1.0;
    m->moe_index = malloc((size_t) n_layer * sizeof *m->moe_index);
    m->vis = calloc((size_t) n_layer, sizeof *m->vis);
    m->last_vis = calloc((size_t) n, sizeof *m->last_vis);
    m->h = calloc((size_t) 3 * n, sizeof *m->h);
    m->mark = calloc((size_t) n_expert, 1);
    m->cnt = calloc((size_t) n_expert, sizeof *m->cnt);
    m->y = calloc((size_t) n_expert, sizeof *m->y);
    m->wait_cache = calloc((size_t) n, sizeof *m->wait_cache);
    m->z_cache = calloc((size_t) n, sizeof *m->z_cache);
    m->e_stamp = malloc((size_t) n * sizeof *m->e_stamp);
    if (!m->moe_index || !m->vis || !m->last_vis || !m->h || !m->mark || !m->cnt || !m->y || !m->wait_cache || !m->z_cache || !m->e_stamp) {
        nv_free(m);
        return NULL;
    }
    for (int32_t l = 0; l < n_layer; l++) m->moe_index[l] = -1;
    for (int32_t i = 0; i < n_moe; i++) m->moe_index[moe_layers[i]] = i;
    for (int32_t f = 0; f < n; f++) m->e_stamp[f] = -1;
    for (int32_t j = 0; j < NV_F; j++) m->w[j] = NV_W0[j];
    m->inv[0] = 0.0;                              /* (score_keys: a key never routed) */
    for (int32_t k = 1; k < NV_INV_N; k++) m->inv[k] = 1.0 / (double) k;
    for (int32_t k = 0; k < 3; k++) {
        double d = 1.0;                           /* (1 - a)^n, one factor at a time */
        for (int32_t i = 0, n = 0; i < NV_ROLL; i++) {
            for (; n < NV_ROLL_AT[i]; n++) d = d * (1.0 - NV_RATES[k]);
            m->decay[i][k] = d;
        }
    }
    return m;
}

void nv_free(nv_model *m) {
    if (m == NULL) return;
    free(m->moe_index); free(m->vis); free(m->last_vis); free(m->h); free(m->mark); free(m->cnt); free(m->y);
    free(m->wait_cache); free(m->z_cache); free(m->e_stamp);
    free(m);
}

/* h_k = (1 - a_k) h_k + a_k y for the three rates over one layer's keys, in one pass: a loop
 * the compiler vectorizes (SSE2 packed doubles: the same IEEE operations, in the same order,
 * as one at a time) */
__attribute__((optimize("tree-vectorize")))
static void ema_layer(double *restrict h0, double *restrict h1, double *restrict h2,
                      const double *restrict y, int32_t ne) {
    const double a0 = NV_RATES[0], a1 = NV_RATES[1], a2 = NV_RATES[2];
    const double b0 = 1.0 - a0, b1 = 1.0 - a1, b2 = 1.0 - a2;
    for (int32_t e = 0; e < ne; e++) {
        const double v = y[e];
        h0[e] = b0 * h0[e] + a0 * v;
        h1[e] = b1 * h1[e] + a1 * v;
        h2[e] = b2 * h2[e] + a2 * v;
    }
}

void nv_visit(nv_model *m, int32_t layer, const int32_t *el, int32_t n, int32_t phase,
              const uint64_t *candidates) {
    const int32_t ne = m->n_expert, nf = m->n_layer * m->n_expert, base = layer * ne;
    for (int32_t i = 0; i < n; i++) m->mark[el[i]] = 1;
    if (phase != 0) {      /* learn: every NV_STRIDE-th expert of the layer, in rotation, */
        double x[NV_F], g[NV_F];                  /* among the eviction candidates */
        for (int32_t j = 0; j < NV_F; j++) g[j] = m->g[j];   /* (in registers) */
        for (int32_t e = (int32_t) (m->steps % NV_STRIDE); e < ne; e += NV_STRIDE) {
            if (!(candidates[e / 64] >> (e % 64) & 1)) continue;
            const int32_t f = base + e;
            nv_features(m, layer, f, x);              /* nv_refresh's z without a second x */
            if (m->e_stamp[f] != nv_stamp(m, layer)) {
                m->z_cache[f] = nv_dot(m->w, x);
                m->wait_cache[f] = NAN;
                m->e_stamp[f] = nv_stamp(m, layer);
            }
            const double p = 1.0 / (1.0 + exp(-m->z_cache[f]));
            const double err = (m->mark[e] ? 1.0 : 0.0) - p;
#pragma GCC unroll 8
            for (int32_t j = 0; j < NV_F; j++) g[j] = g[j] + err * x[j];
        }
        for (int32_t j = 0; j < NV_F; j++) m->g[j] = g[j];
        m->steps++;
        if (m->steps % m->n_moe == 0) {
            for (int32_t j = 0; j < NV_F; j++) {
                m->w[j] = m->w[j] + m->learning_rate * m->g[j];
                m->g[j] = 0.0;
            }
            m->version++;                         /* every score moves */
        }
    }
    m->vis[layer]++;
    int32_t top = 0;                              /* a visit's label: the key's share of */
    for (int32_t i = 0; i < n; i++) m->cnt[el[i]] = 0;   /* routings relative to the most */
    for (int32_t i = 0; i < n; i++)                      /* routed key's (one token: 0 or 1) */
        if (++m->cnt[el[i]] > top) top = m->cnt[el[i]];
    for (int32_t i = 0; i < n; i++) m->y[el[i]] = (double) m->cnt[el[i]] / (double) top;
    ema_layer(&m->h[base], &m->h[nf + base], &m->h[2 * nf + base], m->y, ne);
    for (int32_t i = 0; i < n; i++) {
        m->last_vis[base + el[i]] = m->vis[layer];
        m->y[el[i]] = 0.0;
        m->mark[el[i]] = 0;
    }
    m->cur = layer;
}

void nv_warm_start(nv_model *m, const double *frequency) {
    const int32_t n = m->n_layer * m->n_expert;
    for (int32_t k = 0; k < 3; k++)
        for (int32_t f = 0; f < n; f++) m->h[k * n + f] = frequency[f];
    for (int32_t f = 0; f < n; f++) {             /* an EMA of y in [0, 1] stays in the hull */
        if (frequency[f] < m->h_lo) m->h_lo = frequency[f];
        if (frequency[f] > m->h_hi) m->h_hi = frequency[f];
    }
    m->version++;                                 /* every cached z is stale */
}

/* x ** n, n >= 1, by squaring (the reference multiplies in the same order) */
static inline double int_pow(double x, int32_t n) {
    double r = 1.0;
    for (;;) {
        if (n & 1) r = r * x;
        n >>= 1;
        if (n == 0) return r;
        x = x * x;
    }
}

/* wait = sum over n >= 1 of prod_{m < n} (1 - p_m), p_m from the features rolled m visits
 * forward (not routed: h_k (1 - a_k)^m, age + m), constant over each block of NV_ROLL_LEN
 * visits (its middle's p) and from NV_ROLL_AT's last on. From the last block back:
 *   acc = 1 / p_last;  acc = (1 - q_i) / p_i + q_i acc,  q_i = (1 - p_i)^len_i;
 *   wait = (1 - p_0) acc (len_0 = 1). Each o = exp(-z) (1 / p = 1 + o, 1 - p = o / (1 + o)) */
double nv_roll(const nv_model *m, int32_t layer, int32_t f) {
    const int32_t n = m->n_layer * m->n_expert;
    const int64_t lv = m->last_vis[f], age = m->vis[layer] + 1 - lv;
    const double h0 = m->h[f], h1 = m->h[n + f], h2 = m->h[2 * n + f];
    const double *w = m->w;
    double o[NV_ROLL];
#pragma GCC unroll 8
    for (int32_t i = 0; i < NV_ROLL; i++) {
        const int64_t a = age + NV_ROLL_AT[i];
        const double x1 = lv <= 0 ? 0.0 : a < NV_INV_N ? m->inv[a] : 1.0 / (double) a;
        double z = w[0] * 1.0;
        z = z + w[1] * x1;
        z = z + w[2] * (h0 * m->decay[i][0]);
        z = z + w[3] * (h1 * m->decay[i][1]);
        z = z + w[4] * (h2 * m->decay[i][2]);
        o[i] = exp(-z);
    }
    double acc = 1.0 + o[NV_ROLL - 1];
#pragma GCC unroll 8
    for (int32_t i = NV_ROLL - 2; i >= 1; i--) {
        const double q = int_pow(o[i] / (1.0 + o[i]), NV_ROLL_LEN[i]);
        acc = (1.0 - q) * (1.0 + o[i]) + q * acc;
    }
    const double wait = o[0] / (1.0 + o[0]) * acc;
    return wait == wait ? wait : INFINITY;        /* (an overflowed exp) */
}
