/* next_visit: see next_visit.h. */
#include "next_visit.h"

#include <math.h>
#include <stdlib.h>

#define NV_STRIDE 8     /* learn from one expert in NV_STRIDE per layer-step */

static const double NV_RATES[3] = {0.5, 0.125, 0.03125};
static const double NV_W0[NV_F] = {-3.0, 2.0, 1.0, 2.0, 3.0};   /* p ~ 0.05 for an unseen key */

nv_model *nv_create(int32_t n_layer, int32_t n_expert, const int32_t *moe_layers, int32_t n_moe,
                    double learning_rate) {
    nv_model *m = calloc(1, sizeof *m);
    if (m == NULL) return NULL;
    const int32_t n = n_layer * n_expert;
    m->n_layer = n_layer; m->n_expert = n_expert; m->n_moe = n_moe;
    m->learning_rate = learning_rate;
    m->cur = -1;
    m->moe_index = malloc((size_t) n_layer * sizeof *m->moe_index);
    m->vis = calloc((size_t) n_layer, sizeof *m->vis);
    m->last_vis = calloc((size_t) n, sizeof *m->last_vis);
    m->h = calloc((size_t) 3 * n, sizeof *m->h);
    m->mark = calloc((size_t) n_expert, 1);
    m->cnt = calloc((size_t) n_expert, sizeof *m->cnt);
    m->e_cache = calloc((size_t) n, sizeof *m->e_cache);
    m->e_version = malloc((size_t) n * sizeof *m->e_version);
    m->e_vis = malloc((size_t) n * sizeof *m->e_vis);
    if (!m->moe_index || !m->vis || !m->last_vis || !m->h || !m->mark || !m->cnt || !m->e_cache ||
        !m->e_version || !m->e_vis) {
        nv_free(m);
        return NULL;
    }
    for (int32_t l = 0; l < n_layer; l++) m->moe_index[l] = -1;
    for (int32_t i = 0; i < n_moe; i++) m->moe_index[moe_layers[i]] = i;
    for (int32_t f = 0; f < n; f++) m->e_version[f] = -1;
    for (int32_t j = 0; j < NV_F; j++) m->w[j] = NV_W0[j];
    return m;
}

void nv_free(nv_model *m) {
    if (m == NULL) return;
    free(m->moe_index); free(m->vis); free(m->last_vis); free(m->h); free(m->mark); free(m->cnt);
    free(m->e_cache); free(m->e_version); free(m->e_vis);
    free(m);
}

/* x (NV_F,) of flat f of `layer` for its next visit */
static void features(const nv_model *m, int32_t layer, int32_t f, double *x) {
    const int32_t n = m->n_layer * m->n_expert;
    x[0] = 1.0;
    x[1] = m->last_vis[f] > 0 ? 1.0 / (double) (m->vis[layer] + 1 - m->last_vis[f]) : 0.0;
    x[2] = m->h[f];
    x[3] = m->h[n + f];
    x[4] = m->h[2 * n + f];
}

static double dot(const double *w, const double *x) {
    double z = w[0] * x[0];
    for (int32_t j = 1; j < NV_F; j++) z = z + w[j] * x[j];
    return z;
}

/* exp(-w . x) of f (x its features), computed once per (model version, layer visit) */
static double cached_exp(nv_model *m, int32_t layer, int32_t f, const double *x) {
    if (m->e_version[f] == m->version && m->e_vis[f] == m->vis[layer]) return m->e_cache[f];
    const double e = exp(-dot(m->w, x));
    m->e_cache[f] = e;
    m->e_version[f] = m->version;
    m->e_vis[f] = m->vis[layer];
    return e;
}

void nv_visit(nv_model *m, int32_t layer, const int32_t *el, int32_t n, int32_t phase) {
    const int32_t ne = m->n_expert, nf = m->n_layer * m->n_expert, base = layer * ne;
    for (int32_t i = 0; i < n; i++) m->mark[el[i]] = 1;
    if (phase != 0) {      /* learn: every NV_STRIDE-th expert of the layer, in rotation */
        double x[NV_F];
        for (int32_t e = (int32_t) (m->steps % NV_STRIDE); e < ne; e += NV_STRIDE) {
            features(m, layer, base + e, x);
            const double p = 1.0 / (1.0 + cached_exp(m, layer, base + e, x));
            const double err = (m->mark[e] ? 1.0 : 0.0) - p;
            for (int32_t j = 0; j < NV_F; j++) m->g[j] = m->g[j] + err * x[j];
        }
        m->steps++;
        if (m->steps % m->n_moe == 0) {
            for (int32_t j = 0; j < NV_F; j++) {
                m->w[j] = m->w[j] + m->learning_rate * m->g[j];
                m->g[j] = 0.0;
            }
            m->version++;
        }
    }
    m->vis[layer]++;
    int32_t top = 0;                              /* a visit's label: the key's share of */
    for (int32_t e = 0; e < ne; e++) m->cnt[e] = 0;   /* routings relative to the most */
    for (int32_t i = 0; i < n; i++)                    /* routed key's (one token: 0 or 1) */
        if (++m->cnt[el[i]] > top) top = m->cnt[el[i]];
    for (int32_t e = 0; e < ne; e++) {
        const int32_t f = base + e;
        const double y = m->mark[e] ? (double) m->cnt[e] / (double) top : 0.0;
        for (int32_t k = 0; k < 3; k++) {
            double *h = &m->h[k * nf + f];
            *h = (1.0 - NV_RATES[k]) * *h + NV_RATES[k] * y;
        }
        if (m->mark[e]) m->last_vis[f] = m->vis[layer];
        m->mark[e] = 0;
    }
    m->cur = layer;
}

double nv_expected(nv_model *m, int32_t f) {
    const int32_t layer = f / m->n_expert;
    double e;
    if (m->e_version[f] == m->version && m->e_vis[f] == m->vis[layer]) {
        e = m->e_cache[f];
    } else {
        double x[NV_F];
        features(m, layer, f, x);
        e = cached_exp(m, layer, f, x);
    }
    const int32_t L = m->n_moe;
    const int32_t cur = m->cur >= 0 ? m->moe_index[m->cur] : -1;
    int32_t d = m->moe_index[layer] - cur;       /* 1..L: ((index - cur - 1) mod L) + 1 */
    if (d <= 0) d += L;
    return (double) d + (double) L * e;
}

void nv_warm_start(nv_model *m, const double *frequency) {
    const int32_t n = m->n_layer * m->n_expert;
    for (int32_t k = 0; k < 3; k++)
        for (int32_t f = 0; f < n; f++) m->h[k * n + f] = frequency[f];
    m->version++;                                 /* every cached exp is stale */
}
