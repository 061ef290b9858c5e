/* affinity: see affinity.h. */
#include "affinity.h"
#include "../../../csupport/grow.h"

#include <math.h>
#include <stdlib.h>

#ifdef __SSE2__
#include <emmintrin.h>
#endif

#define AF_DECAY 0.9
#define AF_COUNT_MAX 65535   /* counts and pairs are 16-bit (see af_bump) */
#define AF_PRIOR 8.0   /* the calibration's prior: this many predicted hits at factor 1 */
#define AF_SOURCES 4   /* a token's sources: its first experts in routing order (the router's
                          strongest; AFFINITY_SOURCES in runtime/residency/core/__init__.py) */

af_model *af_create(int32_t n_layer, int32_t n_expert, const int32_t *moe_layers, int32_t n_moe,
                    double top_n, double min_precision, double link_bytes,
                    double max_expert_bytes, const double *rates, int32_t n_expert_used) {
    af_model *m = calloc(1, sizeof *m);
    if (m == NULL) return NULL;
    m->link_bps = rates[0]; m->latency_s = rates[1]; m->gpu_bps = rates[2]; m->cpu_bps = rates[3];
    m->per_transfer = m->link_bps * m->latency_s;
    const double t_max = max_expert_bytes + m->per_transfer;   /* the largest transfer */
    int32_t lead = (int32_t) ceil(2.0 * t_max / link_bytes);
    if (lead < 1) lead = 1;
    if (lead > n_moe - 1) lead = n_moe > 1 ? n_moe - 1 : 1;
    const int32_t np = n_moe > lead ? n_moe - lead : 1, nm = n_moe ? n_moe : 1;
    m->n_layer = n_layer; m->n_expert = n_expert; m->n_moe = n_moe; m->lead = lead;
    m->top_n = top_n; m->min_precision = min_precision; m->link_bytes = link_bytes;
    m->step_ema = -1.0;
    m->tally_keep = 1.0 - 1.0 / (double) nm;     /* about one token's plans remembered */
    m->k = n_expert_used > 0 ? n_expert_used : 0;
    m->moe_index = malloc((size_t) n_layer * sizeof *m->moe_index);
    m->moe_layers = malloc((size_t) nm * sizeof *m->moe_layers);
    m->pair = calloc((size_t) np * n_expert * n_expert, sizeof *m->pair);
    m->count = calloc((size_t) np * n_expert, sizeof *m->count);
    m->src = malloc((size_t) nm * n_expert * sizeof *m->src);
    m->n_src = calloc((size_t) nm, sizeof *m->n_src);
    m->src_step = malloc((size_t) nm * sizeof *m->src_step);
    m->pred = malloc((size_t) nm * n_expert * sizeof *m->pred);
    m->n_pred = malloc((size_t) nm * sizeof *m->n_pred);
    m->mark = calloc((size_t) n_expert, 1);
    m->distinct = malloc((size_t) n_expert * sizeof *m->distinct);
    m->q = calloc((size_t) n_expert, sizeof *m->q);
    m->top_q = calloc((size_t) n_expert, sizeof *m->top_q);
    m->pred_sum = calloc((size_t) nm, sizeof *m->pred_sum);
    m->chunk = calloc((size_t) nm, sizeof *m->chunk);
    m->chunk_cap = calloc((size_t) nm, sizeof *m->chunk_cap);
    m->n_chunk = calloc((size_t) nm, sizeof *m->n_chunk);
    m->chunk_step = malloc((size_t) nm * sizeof *m->chunk_step);
    if (!m->pred_sum || !m->chunk || !m->chunk_cap || !m->n_chunk || !m->chunk_step ||
        !m->moe_index || !m->moe_layers || !m->pair || !m->count || !m->src || !m->n_src ||
        !m->src_step || !m->pred || !m->n_pred || !m->mark || !m->distinct || !m->q ||
        !m->top_q) {
        af_free(m);
        return NULL;
    }
    if (m->k > 0 && n_moe > 0 && n_expert <= INT16_MAX) {   /* the vote needs k */
        m->nb = nb_create(n_moe, n_expert, m->k);
        m->nb_v = calloc((size_t) n_expert, sizeof *m->nb_v);
        m->nb_voted = malloc((size_t) NB_K * m->k * sizeof *m->nb_voted);
        if (m->nb == NULL || m->nb_v == NULL || m->nb_voted == NULL) {
            af_free(m);
            return NULL;
        }
    }
    for (int32_t l = 0; l < n_layer; l++) m->moe_index[l] = -1;
    for (int32_t i = 0; i < n_moe; i++) {
        m->moe_layers[i] = moe_layers[i];
        m->moe_index[moe_layers[i]] = i;
        m->src_step[i] = -1;
        m->chunk_step[i] = -1;
        m->n_pred[i] = -1;
    }
    return m;
}

void af_free(af_model *m) {
    if (m == NULL) return;
    free(m->moe_index); free(m->moe_layers); free(m->pair); free(m->count); free(m->src);
    free(m->n_src); free(m->src_step); free(m->pred); free(m->n_pred); free(m->mark);
    free(m->distinct);
    free(m->q); free(m->top_q); free(m->pred_sum);
    if (m->chunk != NULL)
        for (int32_t i = 0; i < m->n_moe; i++) free(m->chunk[i]);
    free(m->chunk); free(m->chunk_cap); free(m->n_chunk); free(m->chunk_step);
    nb_free(m->nb); free(m->nb_v); free(m->nb_voted);
    free(m);
}

/* count[ie] grows by one (and its row's pairs by at most one each): at AF_COUNT_MAX the row
 * and its count are halved first (integer halves, so every pair stays <= its count and <=
 * AF_COUNT_MAX: the 16-bit table is exact until then, and old tokens weigh half after) */
static inline void af_bump(af_model *m, int64_t ie) {
    if (m->count[ie] >= AF_COUNT_MAX) {
        uint16_t *row = &m->pair[ie * m->n_expert];
        for (int32_t x = 0; x < m->n_expert; x++) row[x] = (uint16_t) (row[x] >> 1);
        m->count[ie] >>= 1;
    }
    m->count[ie]++;
}

/* source expert e of MoE layer si, for one token whose distinct experts at si + lead are d */
static inline void learn_row(af_model *m, int32_t si, int32_t e, const int32_t *d, int32_t nd) {
    const int64_t ie = (int64_t) si * m->n_expert + e;
    af_bump(m, ie);
    uint16_t *row = &m->pair[ie * m->n_expert];
    for (int32_t i = 0; i < nd; i++) row[d[i]]++;
}

/* el's distinct experts into m->distinct, in routing order, marked in m->mark (the caller
 * clears the marks); how many */
static int32_t mark_distinct(af_model *m, const int32_t *el, int32_t n) {
    int32_t *d = m->distinct, nd = 0;
    for (int32_t i = 0; i < n; i++)
        if (!m->mark[el[i]]) {
            m->mark[el[i]] = 1;
            d[nd++] = el[i];
        }
    return nd;
}

/* learn the pairs of a prompt chunk: token t routed to src[t k .. t k + k) at MoE layer si and
 * to el[t k .. t k + k) at si + lead (each token's distinct experts, in routing order) */
static void learn_chunk(af_model *m, int32_t si, const int32_t *src, const int32_t *el,
                        int32_t n) {
    const int32_t k = m->k;
    const int32_t *d = m->distinct;
    for (int32_t t = 0; t + k <= n; t += k) {
        const int32_t nd = mark_distinct(m, &el[t], k);
        for (int32_t i = 0; i < nd; i++) m->mark[d[i]] = 0;
        for (int32_t j = t, ns = 0; j < t + k && ns < AF_SOURCES; j++) {   /* the strongest */
            const int32_t e = src[j];
            int dup = 0;
            for (int32_t i = t; i < j; i++) dup |= src[i] == e;
            if (!dup) { learn_row(m, si, e, d, nd); ns++; }
        }
    }
}

int af_observe(af_model *m, int32_t layer, const int32_t *el, int32_t n, int32_t phase) {
    const int32_t ne = m->n_expert, idx = m->moe_index[layer];
    const int32_t *d = m->distinct, nd = mark_distinct(m, el, n);   /* routing order */
    if (idx >= 0 && m->n_pred[idx] >= 0) {        /* score the plan made for this layer */
        int32_t hit = 0;
        const int32_t *pred = &m->pred[(int64_t) idx * ne];
        for (int32_t j = 0; j < m->n_pred[idx]; j++) hit += m->mark[pred[j]];
        m->hits = m->hits * m->tally_keep + (double) hit;
        m->predicted = m->predicted * m->tally_keep + m->pred_sum[idx];
        m->n_pred[idx] = -1;
    }
    for (int32_t i = 0; i < nd; i++) m->mark[d[i]] = 0;
    if (phase == 1 && idx >= 0 && idx + m->lead < m->n_moe)   /* the rows af_plan will sum */
        for (int32_t i = 0; i < nd && i < AF_SOURCES; i++) {
            const char *row = (const char *) &m->pair[((int64_t) idx * ne + d[i]) * ne];
            for (int32_t b = 0; b < ne * (int32_t) sizeof(uint16_t); b += 64)
                __builtin_prefetch(row + b);
        }
    const int32_t si = idx - m->lead;             /* the source lead layer-steps earlier */
    if (phase == 1 && idx >= 0 && si >= 0 && m->src_step[si] == m->step - m->lead) {
        const int32_t *src = &m->src[(int64_t) si * ne];
        for (int32_t j = 0; j < m->n_src[si]; j++) learn_row(m, si, src[j], d, nd);
    }
    if (phase == 1 && idx >= 0) {
        int32_t *src = &m->src[(int64_t) idx * ne];
        const int32_t ns = nd < AF_SOURCES ? nd : AF_SOURCES;   /* the strongest */
        for (int32_t i = 0; i < ns; i++) src[i] = d[i];
        m->n_src[idx] = ns;
        m->src_step[idx] = m->step;
        if (m->nb != NULL && n <= m->k) {         /* one token */
            nb_decode(m->nb, idx, d, nd);
            if (idx + m->lead < m->n_moe)         /* the rows af_plan's vote reads */
                for (int32_t b = 0; b < m->nb->n_best; b++)
                    __builtin_prefetch(&m->nb->ex[((int64_t) (idx + m->lead) * NB_HISTORY +
                                                   m->nb->best[b]) * m->k]);
        }
    }
    if (phase == 0 && idx >= 0 && m->nb != NULL && n % m->k == 0) nb_chunk(m->nb, idx, el, n);
    if (phase == 0 && idx >= 0 && m->k > 0 && n % m->k == 0) {   /* a prompt chunk */
        if (si >= 0 && m->chunk_step[si] == m->step - m->lead && m->n_chunk[si] == n)
            learn_chunk(m, si, m->chunk[si], el, n);
        if (array_grow((void **) &m->chunk[idx], &m->chunk_cap[idx], n, sizeof(int32_t)))
            return -1;
        for (int32_t i = 0; i < n; i++) m->chunk[idx][i] = el[i];
        m->n_chunk[idx] = n;
        m->chunk_step[idx] = m->step;
    }
    m->step++;
    return 0;
}

/* q[x] = the sum over rows j = 0 .. n - 1, in order, of rows[j][x] * r[j], from 0: the same
 * IEEE operations, in the same order, as adding one row at a time, but in one pass over x that
 * keeps the sums in registers (SSE2: eight experts, four pairs of doubles, at a time); returns
 * the largest q */
static double sum_rows(double *restrict q, const uint16_t *const *rows, const double *r, int32_t n,
                       int32_t ne) {
    int32_t x = 0;
    double top = 0.0;                             /* the largest sum (sums are >= 0) */
#ifdef __SSE2__
    const __m128i zero = _mm_setzero_si128();
    __m128d mx = _mm_setzero_pd();
    for (; x + 8 <= ne; x += 8) {
        __m128d s0 = _mm_setzero_pd(), s1 = s0, s2 = s0, s3 = s0;
        for (int32_t j = 0; j < n; j++) {
            const __m128i v = _mm_loadu_si128((const __m128i *) &rows[j][x]);
            const __m128i lo = _mm_unpacklo_epi16(v, zero), hi = _mm_unpackhi_epi16(v, zero);
            const __m128d rj = _mm_set1_pd(r[j]);
            s0 = _mm_add_pd(s0, _mm_mul_pd(_mm_cvtepi32_pd(lo), rj));
            s1 = _mm_add_pd(s1, _mm_mul_pd(_mm_cvtepi32_pd(_mm_srli_si128(lo, 8)), rj));
            s2 = _mm_add_pd(s2, _mm_mul_pd(_mm_cvtepi32_pd(hi), rj));
            s3 = _mm_add_pd(s3, _mm_mul_pd(_mm_cvtepi32_pd(_mm_srli_si128(hi, 8)), rj));
        }
        _mm_storeu_pd(&q[x], s0); _mm_storeu_pd(&q[x + 2], s1);
        _mm_storeu_pd(&q[x + 4], s2); _mm_storeu_pd(&q[x + 6], s3);
        mx = _mm_max_pd(mx, _mm_max_pd(_mm_max_pd(s0, s1), _mm_max_pd(s2, s3)));
    }
    double lanes[2];
    _mm_storeu_pd(lanes, mx);
    top = lanes[0] > lanes[1] ? lanes[0] : lanes[1];
#endif
    for (; x < ne; x++) {
        double v = 0.0;
        for (int32_t j = 0; j < n; j++) v = v + (double) rows[j][x] * r[j];
        q[x] = v;
        top = v > top ? v : top;
    }
    return top;
}

/* q[x] = -1 (never a candidate) where state[x] is not absent: only keys that need a transfer */
__attribute__((optimize("tree-vectorize")))
static void mask_candidates(double *restrict q, const uint8_t *restrict state, uint8_t absent,
                            int32_t ne) {
    for (int32_t x = 0; x < ne; x++) q[x] = state[x] == absent ? q[x] : -1.0;
}

/* q[x] = b (q[x] inv) */
__attribute__((optimize("tree-vectorize")))
static void scale_table(double *restrict q, double b, double inv, int32_t ne) {
    for (int32_t x = 0; x < ne; x++) q[x] = b * (q[x] * inv);
}

/* the neighbours' vote into q (neighbours.h): 0 when no token voted (q unchanged), else q is
 * the blend, as the mean of one source: (1 - a) (q / n_known) + (a / sum of the voters' sim)
 * times their sum, a = NB_BLEND (1 where the table knew no source: q is 0 there); *top
 * stays >= the largest q (the table's largest, scaled alike, or a voted one) */
static int add_vote(af_model *m, int32_t ti, int32_t n_known, double *top) {
    double tot;
    const int32_t nv = nb_vote(m->nb, ti, m->nb_v, m->nb_voted, &tot);
    const int ok = nv > 0 && tot > 0.0;
    if (ok) {
        const double a = n_known > 0 ? NB_BLEND : 1.0, b = 1.0 - a;
        const double inv = n_known > 0 ? 1.0 / (double) n_known : 0.0;
        scale_table(m->q, b, inv, m->n_expert);
        *top = b * (*top * inv);
        const double w = a / tot;
        for (int32_t i = 0; i < nv; i++) {
            const int32_t x = m->nb_voted[i];
            m->q[x] = m->q[x] + w * m->nb_v[x];
            *top = m->q[x] > *top ? m->q[x] : *top;
        }
    }
    for (int32_t i = 0; i < nv; i++) m->nb_v[m->nb_voted[i]] = 0.0;
    return ok;
}

/* the top_n experts by q (ties: the lower id) among the keys of layer target that need a
 * transfer (a resident or in-flight key is never a candidate, q -1), into pred[ti] / top_q:
 * one pass, kept sorted; how many (q >= 0) */
static int32_t rank_candidates(af_model *m, int32_t ti, int32_t target, const uint8_t *state,
                               uint8_t absent_state) {
    const int32_t ne = m->n_expert;
    int32_t *pred = &m->pred[(int64_t) ti * ne];
    int32_t top = (int32_t) m->top_n, n_top = 0;
    if (top > ne) top = ne;
    if (top < 1) top = 0;
    double *tq = m->top_q;
    mask_candidates(m->q, &state[(int64_t) target * ne], absent_state, ne);
    for (int32_t i = 0; i < top; i++) tq[i] = -1.0;   /* top sentinels, below any q */
    for (int32_t x = 0; x < ne && top > 0; x++) {
        const double v = m->q[x];
        if (!(v > tq[top - 1])) continue;
        int32_t i = top - 1;
        while (i > 0 && v > tq[i - 1]) { pred[i] = pred[i - 1]; tq[i] = tq[i - 1]; i--; }
        pred[i] = x; tq[i] = v;
    }
    while (n_top < top && tq[n_top] >= 0.0) n_top++;
    return n_top;
}

double af_transfer_cost(const af_model *m, int64_t bytes) {
    return (double) bytes + m->per_transfer;
}

/* the plan for MoE index ti (layer target) from its ranked candidates pred / top_q (n_top of
 * them, q summed over n_known sources): those at calibrated q >= min_precision are the plan
 * (scored at ti's visit), and of them what the link carries in its room is issued */
static int32_t finish_plan(af_model *m, int32_t ti, int32_t target, int32_t n_top,
                           int32_t n_known, double cal, double room, const int64_t *bytes_flat,
                           int32_t *out, double *out_q) {
    const int32_t ne = m->n_expert;
    const int32_t *pred = &m->pred[(int64_t) ti * ne];
    const double *tq = m->top_q;
    int32_t n_plan = 0;
    double raw_sum = 0.0;
    for (; n_plan < n_top; n_plan++) {
        const double raw = tq[n_plan] / (double) n_known;
        double q = raw * cal;
        if (!(q > 0.0) || q < m->min_precision) break;   /* (q 0: min_precision 0) */
        if (q > 1.0) q = 1.0;
        raw_sum = raw_sum + raw;
        out_q[n_plan] = q;
        out[n_plan] = target * ne + pred[n_plan];
    }
    m->n_pred[ti] = n_plan;
    m->pred_sum[ti] = raw_sum;
    int32_t n_out = 0;
    for (int32_t j = 0; j < n_plan; j++) {
        const int32_t f = out[j];
        const double cost = af_transfer_cost(m, bytes_flat[f]);
        if (m->backlog + cost > room) continue;
        m->backlog = m->backlog + cost;
        out_q[n_out] = out_q[j];
        out[n_out++] = f;
    }
    return n_out;
}

/* layer idx + lead has no room this step: while the link is idle, the nearest MoE layer up
 * to lead further ahead whose transfers would cross in time and that the neighbours vote for,
 * planned from their vote alone (the pair table holds the layers lead apart only); none
 * pending there. The rest is af_plan's (its candidates, calibrated by cal, the link's room);
 * m->plan_lead says how far ahead it planned. */
static int32_t plan_further(af_model *m, int32_t idx, double step_s, double cal,
                            const uint8_t *state, uint8_t absent_state,
                            const int64_t *bytes_flat, int32_t *out, double *out_q) {
    const int32_t ne = m->n_expert;
    if (m->nb == NULL || m->backlog > 0.0) return 0;
    for (int32_t d = 1; d <= m->lead && idx + m->lead + d < m->n_moe; d++) {
        const int32_t ti = idx + m->lead + d, target = m->moe_layers[ti];
        if (m->n_pred[ti] >= 0) continue;         /* a plan for it is pending */
        const double room = m->link_bps * (step_s + (double) (m->lead - 1 + d) * m->step_ema);
        if (af_transfer_cost(m, bytes_flat[(int64_t) target * ne]) > room) continue;
        for (int32_t x = 0; x < ne; x++) m->q[x] = 0.0;   /* (no table) */
        double top_q = 0.0;
        if (!add_vote(m, ti, 0, &top_q)) continue;  /* nothing known of it: no plan */
        m->plan_lead = m->lead + d;
        const int32_t n_top = rank_candidates(m, ti, target, state, absent_state);
        return finish_plan(m, ti, target, n_top, 1, cal, room, bytes_flat, out, out_q);
    }
    return 0;
}

int32_t af_plan(af_model *m, int32_t layer, int32_t n_hits, int32_t n_misses,
                const uint8_t *state, uint8_t absent_state, const int64_t *bytes_flat,
                int32_t *out, double *out_q) {
    const int32_t ne = m->n_expert;
    const int32_t idx = m->moe_index[layer];
    const double b = (double) bytes_flat[(int64_t) layer * ne];   /* this step's experts' */
    const double hit_s = b / m->gpu_bps, cpu_s = b / m->cpu_bps;   /* compute, seconds */
    double miss_s = m->latency_s + b / m->link_bps + hit_s;
    if (cpu_s < miss_s) miss_s = cpu_s;
    const double step_s = (double) n_hits * hit_s + (double) n_misses * miss_s;
    /* the link worked on the queue while the previous step's experts computed */
    m->backlog = m->backlog - m->link_bps * m->last_step_s;
    if (m->backlog < 0.0) m->backlog = 0.0;
    m->last_step_s = step_s;
    m->step_ema = m->step_ema < 0.0 ? step_s : AF_DECAY * m->step_ema + (1.0 - AF_DECAY) * step_s;
    if (idx < 0 || idx + m->lead >= m->n_moe || m->src_step[idx] != m->step - 1) return 0;
    const int32_t ti = idx + m->lead, target = m->moe_layers[ti];
    /* what the link carries before layer ti's experts start: this step's experts, then
     * lead - 1 more steps of the running estimate (the dense parts not counted); no plan
     * (nor its scoring) when not even one of its transfers would fit */
    const double room = m->link_bps * (step_s + (double) (m->lead - 1) * m->step_ema);
    /* measured hits per predicted one: what a prediction's q is worth */
    const double cal = (m->hits + AF_PRIOR) / (m->predicted + AF_PRIOR);
    m->plan_lead = m->lead;
    if (m->backlog + af_transfer_cost(m, bytes_flat[(int64_t) target * ne]) > room)
        return plan_further(m, idx, step_s, cal, state, absent_state, bytes_flat, out, out_q);
    int32_t n_known = 0;
    const uint16_t *rows[AF_SOURCES];
    double r[AF_SOURCES];
    const int32_t *src = &m->src[(int64_t) idx * ne];
    for (int32_t j = 0; j < m->n_src[idx]; j++) {
        const int32_t e = src[j];
        const int32_t cnt = m->count[idx * ne + e];
        if (cnt == 0) continue;
        rows[n_known] = &m->pair[((int64_t) idx * ne + e) * ne];
        r[n_known++] = 1.0 / (double) cnt;
    }
    double top_q = sum_rows(m->q, rows, r, n_known, ne);
    if (m->nb != NULL && add_vote(m, ti, n_known, &top_q)) n_known = 1;
    if (n_known == 0) return 0;
    if (top_q / (double) n_known * cal < m->min_precision) {   /* nothing can pass: */
        m->n_pred[ti] = 0;                        /* the empty plan, scored at ti's visit */
        m->pred_sum[ti] = 0.0;
        return 0;
    }
    const int32_t n_top = rank_candidates(m, ti, target, state, absent_state);
    return finish_plan(m, ti, target, n_top, n_known, cal, room, bytes_flat, out, out_q);
}

void af_refund(af_model *m, double bytes) {
    m->backlog = m->backlog - bytes;
}

void af_warm_start(af_model *m, const int32_t *pair, const int32_t *count) {
    if (m->n_moe < 2 || m->lead != 1) return;    /* a profile holds consecutive layers only */
    const int64_t ne = m->n_expert, np = m->n_moe - 1;
    for (int64_t ie = 0; ie < np * ne; ie++) {   /* each row, shifted down to 16 bits */
        const int64_t c = (int64_t) m->count[ie] + count[ie];
        int64_t top = c;
        for (int64_t x = 0; x < ne; x++) {
            const int64_t v = (int64_t) m->pair[ie * ne + x] + pair[ie * ne + x];
            if (v > top) top = v;
        }
        int32_t sh = 0;
        while ((top >> sh) > AF_COUNT_MAX) sh++;
        for (int64_t x = 0; x < ne; x++)
            m->pair[ie * ne + x] = (uint16_t) (((int64_t) m->pair[ie * ne + x] +
                                                pair[ie * ne + x]) >> sh);
        m->count[ie] = (int32_t) (c >> sh);
    }
}
