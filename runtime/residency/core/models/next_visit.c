/* next_visit: see next_visit.h. */
#include "next_visit.h"
#include "v2d.h"

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

/* z (NV_ROLL,) at the roll's visits: the features rolled NV_ROLL_AT[i] visits forward (not
 * routed: h_k (1 - a_k)^n, age + n); z[0] is nv_logit's */
static inline void roll_logits(const nv_model *m, int32_t layer, int32_t f, double *z) {
    const int32_t n = m->n_layer * m->n_expert;
    const int64_t lv = m->last_vis[f], age = m->vis[layer] + 1 - lv;
    const double h0 = m->h[f], h1 = m->h[n + f], h2 = m->h[2 * n + f];
    const double *w = m->w;
#pragma GCC unroll 8
    for (int32_t i = 0; i < NV_ROLL; i++) {
        const int64_t a = age + NV_ROLL_AT[i];
        const double x1 = lv <= 0 ? 0.0 : a < NV_INV_N ? m->inv[a] : 1.0 / (double) a;
        double zi = w[0] * 1.0;
        zi = zi + w[1] * x1;
        zi = zi + w[2] * (h0 * m->decay[i][0]);
        zi = zi + w[3] * (h1 * m->decay[i][1]);
        zi = zi + w[4] * (h2 * m->decay[i][2]);
        z[i] = zi;
    }
}

/* wait = sum over n >= 1 of prod_{m < n} (1 - p_m), p_m from the features rolled m visits
 * forward, constant over each block of NV_ROLL_LEN visits (its middle's p) and from
 * NV_ROLL_AT's last on. From the last block back:
 *   acc = 1 / p_last;  acc = (1 - q_i) / p_i + q_i acc,  q_i = (1 - p_i)^len_i;
 *   wait = (1 - p_0) acc (len_0 = 1). o (NV_ROLL,) = exp(-z) (1 / p = 1 + o,
 * 1 - p = o / (1 + o)). As a function of o it grows with each (each 1 - p_m does). Its
 * rounding, for o finite, is < 1e-13 (1 + max o): q = r^56 is within 60 ulp, so 1 - q is
 * within 61 ulp of 1, every other step within an ulp, on terms each < 1 + max o */
static inline double roll_wait(const double *o) {
    double acc = 1.0 + o[NV_ROLL - 1];
#pragma GCC unroll 8
    for (int32_t i = NV_ROLL - 2; i >= 1; i--) {
        const double q = int_pow(o[i] / (1.0 + o[i]), NV_ROLL_LEN[i]);
        acc = (1.0 - q) * (1.0 + o[i]) + q * acc;
    }
    return o[0] / (1.0 + o[0]) * acc;
}

double nv_roll(const nv_model *m, int32_t layer, int32_t f) {
    double z[NV_ROLL], o[NV_ROLL];
    roll_logits(m, layer, f, z);
#pragma GCC unroll 8
    for (int32_t i = 0; i < NV_ROLL; i++) o[i] = exp(-z[i]);
    const double wait = roll_wait(o);
    return wait == wait ? wait : INFINITY;        /* (an overflowed exp) */
}

/* exp(x) of both lanes within a relative 1e-8, |x| <= 700: e^x = 2^k e^u, k = t rounded
 * (t = x log2(e), |t| < 1010: the rounding of t adds < 3e-13), u = (t - k) ln 2 in
 * [-0.347, 0.347], e^u by its Taylor polynomial of degree 7 (Estrin's order; the remainder,
 * relative: < e^0.347 0.347^8 / 8! < 7.3e-9) */
static inline v2d exp_near(v2d x) {
    const v2d round = v2d_set1(6755399441055744.0);   /* 1.5 2^52: t + round rounds t */
    const v2d t = v2d_mul(x, v2d_set1(1.4426950408889634)), kr = v2d_add(t, round);
    const v2d u = v2d_mul(v2d_sub(t, v2d_sub(kr, round)), v2d_set1(0.6931471805599453));
    const v2d u2 = v2d_mul(u, u), u4 = v2d_mul(u2, u2);
    const v2d p01 = v2d_add(v2d_set1(1.0), u);
    const v2d p23 = v2d_add(v2d_set1(0.5), v2d_mul(u, v2d_set1(1.0 / 6.0)));
    const v2d p45 = v2d_add(v2d_set1(1.0 / 24.0), v2d_mul(u, v2d_set1(1.0 / 120.0)));
    const v2d p67 = v2d_add(v2d_set1(1.0 / 720.0), v2d_mul(u, v2d_set1(1.0 / 5040.0)));
    const v2d e = v2d_add(v2d_add(p01, v2d_mul(u2, p23)),
                          v2d_mul(u4, v2d_add(p45, v2d_mul(u2, p67))));
    return v2d_mul(e, v2d_exp2_rounded(kr));     /* 2^k from kr's low bits */
}

/* roll_wait at exp_near's o (z: NV_ROLL = 4), in lanes: (o0, o1), (o2, o3), then the
 * powers of (r1, r2) together; *o_max the largest o */
static double near_wait(const double *z, double *o_max) {
    const v2d one = v2d_set1(1.0);
    const v2d oa = exp_near(v2d_set(-z[0], -z[1])), ob = exp_near(v2d_set(-z[2], -z[3]));
    const v2d ra = v2d_div(oa, v2d_add(one, oa)), rb = v2d_div(ob, v2d_add(one, ob));
    const v2d x = v2d_set(v2d_hi(ra), v2d_lo(rb));           /* (r1, r2) */
    const v2d x2 = v2d_mul(x, x), x4 = v2d_mul(x2, x2), x8 = v2d_mul(x4, x4);
    const v2d x16 = v2d_mul(x8, x8), x32 = v2d_mul(x16, x16);
    const double q1 = v2d_lo(v2d_mul(v2d_mul(x, x2), x4));   /* r1^7 */
    const double q2 = v2d_hi(v2d_mul(v2d_mul(x8, x16), x32)); /* r2^56 */
    const double o1 = v2d_hi(oa), o2 = v2d_lo(ob), o3 = v2d_hi(ob);
    double acc = 1.0 + o3;
    acc = (1.0 - q2) * (1.0 + o2) + q2 * acc;
    acc = (1.0 - q1) * (1.0 + o1) + q1 * acc;
    const v2d top = v2d_max(oa, ob);
    *o_max = fmax(v2d_lo(top), v2d_hi(top));
    return v2d_lo(ra) * acc;
}

/* roll_wait at exp_near's o, widened by what that moves it: each o within 1e-8, and
 * roll_wait's relative change is < 1 + 2 (len_1 + 1) + 2 (len_2 + 1) = 131 times the o's
 * (to first order: r, 1 + o and 1 - q change by less than once o's, q by len times); and
 * both evaluations' rounding, < 1e-13 (1 + max o) each: < 2e-10 (1 + the estimate) where
 * the largest o is < 1e3 (1 + the estimate) (else the wait itself is computed: a candidate
 * with p near 1 at the next visit). The estimate is kept in wait_cache as its negative
 * until the key's stamp moves */
int nv_wait_bounds(nv_model *m, int32_t layer, int32_t f, double *lo, double *hi) {
    (void) nv_logit(m, layer, f);                 /* (the stamp) */
    double c = m->wait_cache[f];
    if (c >= 0.0) {                               /* known */
        *lo = *hi = c;
        return 1;
    }
    if (c != c) {                                 /* no estimate yet */
        double z[NV_ROLL], o_max;
        roll_logits(m, layer, f, z);
        int in_range = 1;                         /* (no NaN, no overflow, no subnormal) */
#pragma GCC unroll 8
        for (int32_t i = 0; i < NV_ROLL; i++) in_range &= fabs(z[i]) <= 700.0;
        const double near = in_range ? near_wait(z, &o_max) : 0.0;
        if (!in_range || !(o_max < 1e3 * (1.0 + near))) {
            *lo = *hi = nv_wait(m, layer, f);
            return 1;
        }
        c = m->wait_cache[f] = -near;
    }
    const double near = -c, margin = 1e-9 * (1.0 + near);
    *lo = near * (1.0 - 4e-6) - margin;
    *hi = near * (1.0 + 4e-6) + margin;
    return 0;
}
