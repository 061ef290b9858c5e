/* neighbours: see neighbours.h. */
#include "neighbours.h"

#include <stdlib.h>
#include <string.h>

#define H NB_HISTORY
#define SLOT(t) ((int32_t) ((t) % H))

nb_model *nb_create(int32_t n_moe, int32_t n_expert, int32_t k) {
    if (n_moe < 1 || k < 1 || n_expert > INT16_MAX) return NULL;
    nb_model *m = calloc(1, sizeof *m);
    if (m == NULL) return NULL;
    m->n_moe = n_moe; m->n_expert = n_expert; m->k = k;
    m->cur = -1; m->last_idx = n_moe; m->p_idx = n_moe; m->p_n = -1;
    const size_t cells = (size_t) n_moe * H * k, lists = (size_t) n_moe * n_expert;
    m->slot_t = malloc(H * sizeof *m->slot_t);
    m->ex = malloc(cells * sizeof *m->ex);
    m->member = calloc(lists * NB_WORDS, sizeof *m->member);
    m->n_member = calloc(lists, sizeof *m->n_member);
    m->sim = calloc(H, sizeof *m->sim);
    m->inc = malloc((size_t) n_moe * sizeof *m->inc);
    if (!m->slot_t || !m->ex || !m->member || !m->n_member || !m->sim || !m->inc) {
        nb_free(m);
        return NULL;
    }
    for (int32_t h = 0; h < H; h++) m->slot_t[h] = -1;
    for (size_t i = 0; i < cells; i++) m->ex[i] = -1;
    const double up = 1.0 / NB_DECAY;
    m->inc[0] = 1.0;
    for (int32_t i = 1; i < n_moe; i++) m->inc[i] = m->inc[i - 1] * up;
    return m;
}

void nb_free(nb_model *m) {
    if (m == NULL) return;
    free(m->slot_t); free(m->ex); free(m->member); free(m->n_member);
    free(m->sim); free(m->inc);
    free(m);
}

/* the next token number, in a slot emptied of the token it held (which leaves the window) */
static int64_t new_token(nb_model *m) {
    const int64_t t = m->n_tok++;
    const int32_t h = SLOT(t);
    const uint64_t keep = ~(1ull << (h % 64));
    m->slot_t[h] = t;
    for (int32_t i = 0; i < m->n_moe; i++) {
        int16_t *ex = &m->ex[((int64_t) i * H + h) * m->k];
        for (int32_t j = 0; j < m->k && ex[j] >= 0; j++) {
            const int64_t l = (int64_t) i * m->n_expert + ex[j];
            m->member[l * NB_WORDS + h / 64] &= keep;
            m->n_member[l]--;
            ex[j] = -1;
        }
    }
    return t;
}

/* token t's distinct experts d[nd] at MoE index i (at most k), in its slot */
static void record(nb_model *m, int64_t t, int32_t i, const int32_t *d, int32_t nd) {
    const int32_t h = SLOT(t);
    int16_t *ex = &m->ex[((int64_t) i * H + h) * m->k];
    if (nd > m->k) nd = m->k;
    for (int32_t j = 0; j < nd; j++) {
        ex[j] = (int16_t) d[j];
        const int64_t l = (int64_t) i * m->n_expert + d[j];
        m->member[l * NB_WORDS + h / 64] |= 1ull << (h % 64);
        m->n_member[l]++;
    }
}

/* (s, t) ranks above (bs, bt): the higher sim, then the newer token */
static inline int above(double s, int64_t t, double bs, int64_t bt) {
    return s > bs || (s == bs && t > bt);
}

/* slot h (token t) had its sim grow to s: keep best[] the NB_K highest (sim, token), in
 * order. Sims only grow within a token, so a slot can only enter the list when it grows, and
 * one that does not rank above the last listed is not listed (most calls stop there). */
static inline void rank(nb_model *m, int32_t h, int64_t t, double s) {
    const int32_t l = NB_K - 1;
    if (m->n_best == NB_K && !above(s, t, m->best_s[l], m->best_t[l])) return;
    int32_t p = 0;
    while (p < m->n_best && m->best[p] != h) p++;
    if (p == m->n_best) p = m->n_best < NB_K ? m->n_best++ : l;   /* enters (the last leaves) */
    while (p > 0 && above(s, t, m->best_s[p - 1], m->best_t[p - 1])) {
        m->best[p] = m->best[p - 1];
        m->best_s[p] = m->best_s[p - 1];
        m->best_t[p] = m->best_t[p - 1];
        p--;
    }
    m->best[p] = h;
    m->best_s[p] = s;
    m->best_t[p] = t;
}

void nb_decode(nb_model *m, int32_t idx, const int32_t *d, int32_t nd) {
    if (idx <= m->last_idx) {                     /* a new token */
        m->cur = new_token(m);
        m->n_best = 0;
        memset(m->sim, 0, H * sizeof *m->sim);
    }
    m->last_idx = idx;
    m->p_idx = m->n_moe;                          /* the next prompt chunk starts tokens */
    const double inc = m->inc[idx];
    for (int32_t a = 0; a < nd && a < NB_WALK; a++) {    /* the tokens routed to d[a] here */
        const int64_t l = (int64_t) idx * m->n_expert + d[a];
        if (m->n_member[l] > NB_COMMON) continue;          /* too common to tell tokens apart */
        const uint64_t *w = &m->member[l * NB_WORDS];
        for (int32_t b = 0; b < NB_WORDS; b++)
            for (uint64_t bits = w[b]; bits; bits &= bits - 1) {
                const int32_t h = b * 64 + __builtin_ctzll(bits);
                m->sim[h] = m->sim[h] + inc;
                rank(m, h, m->slot_t[h], m->sim[h]);
            }
    }
    record(m, m->cur, idx, d, nd);
}

void nb_chunk(nb_model *m, int32_t idx, const int32_t *el, int32_t n) {
    const int32_t k = m->k, nt = n / k;
    if (idx <= m->p_idx || n != m->p_n) {         /* a new prompt batch: its tokens */
        m->p_base = m->n_tok;
        for (int32_t t = 0; t < nt; t++) new_token(m);
        m->p_n = n;
    }
    m->p_idx = idx;
    m->last_idx = m->n_moe;                       /* the next decode layer-step starts a token */
    m->cur = -1;
    for (int32_t t = 0; t < nt; t++) {
        if (m->p_base + t < m->n_tok - H) continue;    /* already out of the window */
        int32_t d[NB_K_MAX], nd = 0;
        for (int32_t j = 0; j < k && nd < NB_K_MAX; j++) {   /* its distinct experts */
            const int32_t e = el[t * k + j];
            int dup = 0;
            for (int32_t i = 0; i < nd; i++) dup |= d[i] == e;
            if (!dup) d[nd++] = e;
        }
        record(m, m->p_base + t, idx, d, nd);
    }
}

void nb_warm_start(nb_model *m, const int16_t *h, int32_t n, int32_t hk) {
    int32_t d[NB_K_MAX];
    for (int32_t t = 0; t < n; t++) {
        const int64_t tok = new_token(m);
        for (int32_t i = 0; i < m->n_moe; i++) {
            const int16_t *row = &h[((int64_t) t * m->n_moe + i) * hk];
            int32_t nd = 0;
            for (int32_t j = 0; j < hk && nd < NB_K_MAX && row[j] >= 0; j++) d[nd++] = row[j];
            record(m, tok, i, d, nd);
        }
    }
    m->cur = -1;                                  /* the next decode layer-step starts a token */
    m->last_idx = m->n_moe;
    m->p_idx = m->n_moe;
}

int32_t nb_vote(const nb_model *m, int32_t ti, double *v, int32_t *voted, double *tot) {
    *tot = 0.0;
    if (m->cur < 0) return 0;
    int32_t n = 0;
    for (int32_t b = 0; b < m->n_best; b++) {
        const int16_t *ex = &m->ex[((int64_t) ti * H + m->best[b]) * m->k];
        if (ex[0] < 0) continue;                  /* nothing recorded at ti */
        const double s = m->best_s[b];
        for (int32_t j = 0; j < m->k && ex[j] >= 0; j++) {   /* (no branch on v: it */
            const int32_t e = ex[j];                              /* is not predictable) */
            voted[n] = e;
            n += v[e] == 0.0;
            v[e] = v[e] + s;
        }
        *tot = *tot + s;
    }
    return n;
}
