/* nv_lists: eviction next-visit's per-layer lists (nv_victim.h): each layer's membership in
 * the order (a bitmap) and a prefix of its keys in (z, last seq, flat), kept between calls.
 * nv_victim.c calls this file, never the other way (what both need is nv_victim_impl.h). */
#include "nv_victim_impl.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>
#ifdef __SSE2__
#include <emmintrin.h>
#endif

/* a key that is a member but not listed: every such key's z is >= list_bound */
static inline void unlisted(nv_victim *s, int32_t l, double z) {
    if (z < s->list_bound[l]) s->list_bound[l] = z;
}

void nvv_push(nv_victim *s, int32_t f, int64_t last_seq) {
    const int32_t l = f / s->n_expert, e = f - l * s->n_expert;
    s->members[l * s->n_words + e / 64] |= (uint64_t) 1 << (e % 64);
    s->last_seq[f] = last_seq;
    mark_layer(s, l);
    if (!list_valid(s, l)) {                      /* refilled on its next use anyway */
        s->list_vis[l] = -1;                      /* (not re-sorted: f's z is not bounded) */
        return;
    }
    int32_t *list = &s->list[l * NV_LIST];
    int32_t n = s->list_n[l];
    const double z = nv_logit(s->nv, l, f);
    int32_t i = n;
    while (i > 0 && z_below(s, z, f, nv_logit(s->nv, l, list[i - 1]), list[i - 1])) i--;
    if (i == n && (!s->list_all[l] || n == NV_LIST)) {  /* above the list (unknown keys may
                                                           be lower, or it is full) */
        s->list_all[l] = 0;
        unlisted(s, l, z);
        return;
    }
    if (n == NV_LIST) {                           /* the last drops out */
        n--;
        s->list_all[l] = 0;
        unlisted(s, l, nv_logit(s->nv, l, list[n]));
        s->in_list[list[n]] = 0;
    }
    for (int32_t j = n; j > i; j--) list[j] = list[j - 1];
    list[i] = f;
    s->in_list[f] = 1;
    s->list_n[l] = n + 1;
}

void nvv_remove(nv_victim *s, int32_t f) {
    const int32_t l = f / s->n_expert, e = f - l * s->n_expert;
    s->members[l * s->n_words + e / 64] &= ~((uint64_t) 1 << (e % 64));
    mark_layer(s, l);
    if (!s->in_list[f]) return;
    s->in_list[f] = 0;
    int32_t *list = &s->list[l * NV_LIST];
    const int32_t n = s->list_n[l];
    for (int32_t i = 0; i < n; i++)
        if (list[i] == f) {
            for (int32_t j = i + 1; j < n; j++) list[j - 1] = list[j];
            s->list_n[l] = n - 1;
            return;
        }
}

/* zs[i] = z of flat ids[i] of `layer` for its next visit (nv_refresh's arithmetic, in its
 * order), into the model's cache too */
static void score_keys(nv_model *m, int32_t layer, const int32_t *restrict ids, int32_t n,
                       double *restrict zs) {
    const int64_t stamp = nv_stamp(m, layer), vis1 = m->vis[layer] + 1;
    const int32_t nf = m->n_layer * m->n_expert;
    const int64_t *restrict last_vis = m->last_vis;
    const double *restrict inv = m->inv;          /* inv[0] = 0: a key never routed */
    const double *restrict h0 = m->h, *restrict h1 = m->h + nf, *restrict h2 = m->h + 2 * nf;
    double *restrict z_cache = m->z_cache, *restrict wait_cache = m->wait_cache;
    int64_t *restrict e_stamp = m->e_stamp;
    const double w0 = m->w[0], w1 = m->w[1], w2 = m->w[2], w3 = m->w[3], w4 = m->w[4];
    for (int32_t i = 0; i < n; i++) {
        const int32_t g = ids[i];
        const int64_t lv = last_vis[g], age = lv <= 0 ? 0 : vis1 - lv;
        const double x1 = age < NV_INV_N ? inv[age] : 1.0 / (double) age;
        double z = w0 * 1.0;
        z = z + w1 * x1;
        z = z + w2 * h0[g];
        z = z + w3 * h1[g];
        z = z + w4 * h2[g];
        zs[i] = z;
        z_cache[g] = z;
        wait_cache[g] = NAN;
        e_stamp[g] = stamp;
    }
}

/* out (NV_LIST + 1,) = the least values of zs[0 .. n), ascending (+inf past n): a min/max
 * cascade, with no branches (values are only moved, never computed) */
static void least_values(const double *zs, int32_t n, double *out) {
#ifdef __SSE2__
    __m128d l[NV_LIST + 1];
#pragma GCC unroll 16
    for (int32_t j = 0; j <= NV_LIST; j++) l[j] = _mm_set_sd(INFINITY);
    for (int32_t i = 0; i < n; i++) {
        __m128d v = _mm_load_sd(&zs[i]);
#pragma GCC unroll 16
        for (int32_t j = 0; j <= NV_LIST; j++) {
            const __m128d lo = _mm_min_sd(v, l[j]);
            v = _mm_max_sd(v, l[j]);
            l[j] = lo;
        }
    }
#pragma GCC unroll 16
    for (int32_t j = 0; j <= NV_LIST; j++) _mm_store_sd(&out[j], l[j]);
#else
    for (int32_t j = 0; j <= NV_LIST; j++) out[j] = INFINITY;
    for (int32_t i = 0; i < n; i++) {
        double v = zs[i];
        for (int32_t j = 0; j <= NV_LIST; j++) {
            const double lo = v < out[j] ? v : out[j], hi = v < out[j] ? out[j] : v;
            out[j] = lo;
            v = hi;
        }
    }
#endif
}

/* *top, *bound = the NV_LIST-th and (NV_LIST + 1)-th least of zs[0 .. n) (+inf past n):
 * least_values' cascade on two lanes (even and odd i) at once, then the least NV_LIST + 1
 * of both lanes' (a lane's ascending, the other's descending: their minima, a half-cleaner),
 * of which bound is the largest and top the next. A NaN anywhere: least_values itself (the
 * values it moves around a NaN are its own) */
static void least_two(const double *zs, int32_t n, double *top, double *bound) {
#ifdef __SSE2__
    __m128d l[NV_LIST + 1], nan = _mm_setzero_pd();
#pragma GCC unroll 16
    for (int32_t j = 0; j <= NV_LIST; j++) l[j] = _mm_set1_pd(INFINITY);
    for (int32_t i = 0; i < n; i += 2) {
        __m128d v = i + 1 < n ? _mm_loadu_pd(&zs[i]) : _mm_set_pd(INFINITY, zs[i]);
        nan = _mm_or_pd(nan, _mm_cmpunord_pd(v, v));
#pragma GCC unroll 16
        for (int32_t j = 0; j <= NV_LIST; j++) {
            const __m128d lo = _mm_min_pd(v, l[j]);
            v = _mm_max_pd(v, l[j]);
            l[j] = lo;
        }
    }
    if (!_mm_movemask_pd(nan)) {
        double a[NV_LIST + 1][2], m1 = -INFINITY, m2 = -INFINITY;
        for (int32_t j = 0; j <= NV_LIST; j++) _mm_storeu_pd(a[j], l[j]);
        for (int32_t j = 0; j <= NV_LIST; j++) {
            const double lo = a[j][0], hi = a[NV_LIST - j][1], c = lo < hi ? lo : hi;
            m2 = c > m2 ? (c < m1 ? c : m1) : m2;
            m1 = c > m1 ? c : m1;
        }
        *top = m2;
        *bound = m1;
        return;
    }
#endif
    double least[NV_LIST + 1];
    least_values(zs, n, least);
    *top = least[NV_LIST - 1];
    *bound = least[NV_LIST];
}

/* the layer's list: its NV_LIST lowest keys in (z, last seq, flat). Every member is
 * rescored here (its layer was visited, the weights moved past what resort_list can bound,
 * or the list ran dry) */
__attribute__((noinline))
void nvl_fill_list(nv_victim *s, int32_t layer) {
    nv_model *m = s->nv;
    int32_t *ids = s->ids, n = 0;
    double *zs = s->zs;
    int32_t *list = &s->list[layer * NV_LIST];
    for (int32_t i = 0; i < s->list_n[layer]; i++) s->in_list[list[i]] = 0;
    FOR_MEMBERS(s, layer, g) ids[n++] = g;
    score_keys(m, layer, ids, n, zs);
    double top, bound;
    least_two(zs, n, &top, &bound);
    /* the keys at or below the NV_LIST-th value, in (z, last seq, flat); the first NV_LIST
     * are the list; every other key's z is >= the (NV_LIST + 1)-th value */
    int32_t *sel = s->sel, n_sel = 0;
    for (int32_t i = 0; i < n; i++) {
        sel[n_sel] = i;
        n_sel += zs[i] <= top;
    }
    for (int32_t a = 1; a < n_sel; a++) {
        const int32_t i = sel[a];
        int32_t b = a;
        while (b > 0 && z_below(s, zs[i], ids[i], zs[sel[b - 1]], ids[sel[b - 1]])) {
            sel[b] = sel[b - 1];
            b--;
        }
        sel[b] = i;
    }
    const int32_t n_list = n_sel < NV_LIST ? n_sel : NV_LIST;
    for (int32_t a = 0; a < n_list; a++) {
        list[a] = ids[sel[a]];
        s->in_list[list[a]] = 1;
    }
    s->list_n[layer] = n_list;
    s->list_all[layer] = n <= NV_LIST;
    s->list_bound[layer] = bound;
    for (int32_t j = 0; j < NV_F; j++) s->list_w[layer * NV_F + j] = m->w[j];
    s->list_vis[layer] = m->vis[layer];
    s->list_ver[layer] = m->version;
}

/* the weights moved since the list's order, its layer's features did not: every member's z
 * moved by dw . x, x in the features' box (x0 = 1, 1/age in [0, 1], h in [h_lo, h_hi]), so
 * the unlisted keys' z are >= bound + (the least dw . x over the box) - slack (rounding).
 * The listed keys are rescored: those strictly below that are the lowest members, in order;
 * the others leave the list (the bound covers them). */
void nvl_resort_list(nv_victim *s, int32_t layer) {
    nv_model *m = s->nv;
    int32_t *list = &s->list[layer * NV_LIST];
    double *wb = &s->list_w[layer * NV_F];
    double t = s->list_bound[layer];
    if (t != INFINITY) {
        double least = m->w[0] - wb[0], size = 1.0;
        const double d1 = m->w[1] - wb[1];
        least += d1 < 0.0 ? d1 : 0.0;
        for (int32_t j = 2; j < NV_F; j++) {
            const double d = m->w[j] - wb[j], a = d * m->h_lo, b = d * m->h_hi;
            least += a < b ? a : b;
        }
        for (int32_t j = 0; j < NV_F; j++) size += fabs(m->w[j]) + fabs(wb[j]);
        const double xmax = fmax(1.0, fmax(-m->h_lo, m->h_hi));
        t = t + least - 1e-9 * size * xmax - 1e-9 * fabs(t);
    }
    double lz[NV_LIST];
    int32_t n = 0;
    for (int32_t i = 0; i < s->list_n[layer]; i++) {
        const int32_t g = list[i];
        const double z = nv_logit(m, layer, g);
        if (!(z < t)) {
            s->in_list[g] = 0;
            continue;
        }
        int32_t k = n++;
        while (k > 0 && z_below(s, z, g, lz[k - 1], list[k - 1])) {
            list[k] = list[k - 1]; lz[k] = lz[k - 1]; k--;
        }
        list[k] = g; lz[k] = z;
    }
    /* (unlisted keys' bound: t; the dropped listed keys are >= t too) */
    if (n < s->list_n[layer]) s->list_all[layer] = 0;
    s->list_n[layer] = n;
    s->list_bound[layer] = t;
    for (int32_t j = 0; j < NV_F; j++) wb[j] = m->w[j];
    s->list_ver[layer] = m->version;
}

