/* affinity: see affinity.h. */
#include "affinity.h"

#include <stdlib.h>

#define AF_DECAY 0.9
#define AF_WARMUP 8.0

af_model *af_create(int32_t n_layer, int32_t n_expert, const int32_t *moe_layers, int32_t n_moe,
                    double top_n, double min_precision, double link_bytes) {
    af_model *m = calloc(1, sizeof *m);
    if (m == NULL) return NULL;
    const int32_t np = n_moe > 1 ? n_moe - 1 : 1;
    m->n_layer = n_layer; m->n_expert = n_expert; m->n_moe = n_moe;
    m->top_n = top_n; m->min_precision = min_precision; m->link_bytes = link_bytes;
    m->prev_layer = m->pred_layer = -1;
    m->moe_index = malloc((size_t) n_layer * sizeof *m->moe_index);
    m->moe_layers = malloc((size_t) (n_moe ? n_moe : 1) * sizeof *m->moe_layers);
    m->pair = calloc((size_t) np * n_expert * n_expert, sizeof *m->pair);
    m->count = calloc((size_t) np * n_expert, sizeof *m->count);
    m->prev = malloc((size_t) n_expert * sizeof *m->prev);
    m->pred = malloc((size_t) n_expert * sizeof *m->pred);
    m->mark = calloc((size_t) n_expert, 1);
    m->q = calloc((size_t) n_expert, sizeof *m->q);
    if (!m->moe_index || !m->moe_layers || !m->pair || !m->count || !m->prev || !m->pred ||
        !m->mark || !m->q) {
        af_free(m);
        return NULL;
    }
    for (int32_t l = 0; l < n_layer; l++) m->moe_index[l] = -1;
    for (int32_t i = 0; i < n_moe; i++) {
        m->moe_layers[i] = moe_layers[i];
        m->moe_index[moe_layers[i]] = i;
    }
    return m;
}

void af_free(af_model *m) {
    if (m == NULL) return;
    free(m->moe_index); free(m->moe_layers); free(m->pair); free(m->count); free(m->prev);
    free(m->pred); free(m->mark); free(m->q);
    free(m);
}

void af_observe(af_model *m, int32_t layer, const int32_t *el, int32_t n, int32_t phase) {
    const int32_t ne = m->n_expert;
    for (int32_t i = 0; i < n; i++) m->mark[el[i]] = 1;
    if (m->pred_layer == layer) {                  /* score the plan made for this layer */
        int32_t hit = 0;
        for (int32_t j = 0; j < m->n_pred; j++) hit += m->mark[m->pred[j]];
        m->hits = m->hits * AF_DECAY + (double) hit;
        m->scored = m->scored * AF_DECAY + (double) m->n_pred;
    }
    m->pred_layer = -1;
    const int32_t idx = m->moe_index[layer];
    if (phase == 1 && m->prev_layer >= 0 && idx == m->moe_index[m->prev_layer] + 1) {
        const int32_t pi = idx - 1;
        for (int32_t j = 0; j < m->n_prev; j++) {
            const int32_t e = m->prev[j];
            m->count[pi * ne + e]++;
            int32_t *row = &m->pair[((int64_t) pi * ne + e) * ne];
            for (int32_t x = 0; x < ne; x++) row[x] += m->mark[x];
        }
    }
    m->n_prev = 0;
    m->prev_layer = -1;
    if (phase == 1) {                              /* distinct, routing order */
        for (int32_t i = 0; i < n; i++)
            if (m->mark[el[i]] == 1) {
                m->prev[m->n_prev++] = el[i];
                m->mark[el[i]] = 2;
            }
        m->prev_layer = layer;
    }
    for (int32_t i = 0; i < n; i++) m->mark[el[i]] = 0;
}

int32_t af_plan(af_model *m, int32_t layer, const uint8_t *state, uint8_t absent_state,
                const int64_t *bytes_flat, int32_t *out, double *out_q) {
    const int32_t ne = m->n_expert;
    const int32_t idx = m->moe_index[layer];
    m->credit = m->link_bytes;                   /* what can arrive before the next layer */
    if (m->prev_layer != layer || idx < 0 || idx + 1 >= m->n_moe) return 0;
    int32_t n_known = 0;
    for (int32_t x = 0; x < ne; x++) m->q[x] = 0.0;
    for (int32_t j = 0; j < m->n_prev; j++) {
        const int32_t e = m->prev[j];
        const int32_t cnt = m->count[idx * ne + e];
        if (cnt == 0) continue;
        n_known++;
        const int32_t *row = &m->pair[((int64_t) idx * ne + e) * ne];
        for (int32_t x = 0; x < ne; x++) m->q[x] = m->q[x] + (double) row[x] / (double) cnt;
    }
    if (n_known == 0) return 0;
    const int32_t target = m->moe_layers[idx + 1];
    int32_t n_plan = 0;
    const int32_t top = (int32_t) m->top_n;
    for (int32_t k = 0; k < top && k < ne; k++) {  /* the top by q, lower id on ties */
        int32_t best = -1;
        double best_q = -1.0;
        for (int32_t x = 0; x < ne; x++) {
            if (m->mark[x]) continue;
            if (m->q[x] > best_q) { best_q = m->q[x]; best = x; }
        }
        if (best < 0) break;
        m->mark[best] = 1;
        const double q = best_q / (double) n_known;
        if (q < m->min_precision) break;
        m->pred[n_plan] = best;
        out_q[n_plan] = q;
        out[n_plan++] = target * ne + best;
    }
    for (int32_t x = 0; x < ne; x++) m->mark[x] = 0;
    m->n_pred = n_plan;
    m->pred_layer = target;
    if (m->scored >= AF_WARMUP && m->hits < m->min_precision * m->scored) return 0;
    int32_t n_out = 0;
    for (int32_t j = 0; j < n_plan; j++) {
        const int32_t f = out[j];
        if (state[f] == absent_state) {
            if (m->credit < (double) bytes_flat[f]) continue;
            m->credit = m->credit - (double) bytes_flat[f];
        }
        out_q[n_out] = out_q[j];
        out[n_out++] = f;
    }
    return n_out;
}

void af_refund(af_model *m, double bytes) {
    m->credit = m->credit + bytes;
}

void af_warm_start(af_model *m, const int32_t *pair, const int32_t *count) {
    if (m->n_moe < 2) return;
    const int64_t ne = m->n_expert, np = m->n_moe - 1;
    for (int64_t i = 0; i < np * ne * ne; i++) m->pair[i] += pair[i];
    for (int64_t i = 0; i < np * ne; i++) m->count[i] += count[i];
}
