/* nv_victim: see nv_victim.h. */
#include "nv_victim_impl.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>
#ifdef __SSE2__
#include <emmintrin.h>
#endif

nv_victim *nvv_create(nv_model *nv, int32_t n_layer, int32_t n_expert,
                      const int32_t *moe_layers, int32_t n_moe) {
    nv_victim *s = calloc(1, sizeof *s);
    if (s == NULL) return NULL;
    s->nv = nv;
    s->n_layer = n_layer; s->n_expert = n_expert; s->n_moe = n_moe;
    s->n_words = (n_expert + 63) / 64;
    const size_t k = (size_t) (n_moe ? n_moe : 1), n_flat = (size_t) n_layer * n_expert;
    s->moe_layers = malloc(k * sizeof *s->moe_layers);
    s->last_seq = malloc(n_flat * sizeof *s->last_seq);
    s->holds = calloc(n_flat, sizeof *s->holds);
    s->members = calloc((size_t) n_layer * s->n_words, sizeof *s->members);
    s->in_list = calloc((size_t) n_layer * n_expert, 1);
    s->ids = malloc((size_t) (n_expert ? n_expert : 1) * sizeof *s->ids);
    s->zs = malloc((size_t) (n_expert ? n_expert : 1) * sizeof *s->zs);
    s->sel = malloc((size_t) (n_expert ? n_expert : 1) * sizeof *s->sel);
    s->list = malloc(((size_t) n_layer * NV_LIST + 1) * sizeof *s->list);
    s->list_n = calloc((size_t) n_layer, sizeof *s->list_n);
    s->list_all = calloc((size_t) n_layer, 1);
    s->list_vis = malloc((size_t) n_layer * sizeof *s->list_vis);
    s->list_ver = calloc((size_t) n_layer, sizeof *s->list_ver);
    s->list_bound = calloc((size_t) n_layer, sizeof *s->list_bound);
    s->list_w = calloc((size_t) n_layer * NV_F, sizeof *s->list_w);
    s->cand = malloc(k * sizeof *s->cand);
    s->pool = calloc(k, sizeof *s->pool);
    s->cand_z = calloc(k, sizeof *s->cand_z);
    s->cand_le = calloc(k, sizeof *s->cand_le);
    s->cand_lo = calloc(k, sizeof *s->cand_lo);
    s->cand_s = calloc(k, sizeof *s->cand_s);
    s->masked = calloc(k, sizeof *s->masked);
    s->exact = calloc(k, 1);
    s->dirty = calloc(k, 1);
    s->dep = calloc(k, 1);
    s->dirty_list = malloc(k * sizeof *s->dirty_list);
    if (!s->moe_layers || !s->last_seq || !s->holds || !s->members || !s->in_list || !s->ids ||
        !s->zs || !s->sel || !s->list || !s->list_n || !s->list_all || !s->list_vis ||
        !s->list_ver || !s->list_bound || !s->list_w || !s->cand || !s->pool || !s->cand_z ||
        !s->cand_le || !s->cand_lo || !s->cand_s || !s->masked || !s->exact || !s->dirty ||
        !s->dep || !s->dirty_list) {
        nvv_free(s);
        return NULL;
    }
    memcpy(s->moe_layers, moe_layers, (size_t) n_moe * sizeof *moe_layers);
    for (size_t f = 0; f < n_flat; f++) s->last_seq[f] = -1;
    for (int32_t i = 0; i < n_moe; i++) {
        s->cand[i] = -1;
        s->cand_s[i] = INFINITY;
        s->cand_le[i] = s->cand_lo[i] = -INFINITY;
    }
    s->list[n_layer * NV_LIST] = -1;              /* a guard: nvv_verify checks it */
    s->seq0 = -1;
    s->s_cur = -2;                                /* no current layer yet computed for */
    nvv_stale_all(s);
    return s;
}

void nvv_free(nv_victim *s) {
    if (s == NULL) return;
    free(s->moe_layers); free(s->last_seq); free(s->holds);
    free(s->members); free(s->in_list); free(s->ids); free(s->zs); free(s->sel); free(s->list);
    free(s->list_n); free(s->list_all); free(s->list_vis);
    free(s->list_ver); free(s->list_bound); free(s->list_w);
    free(s->cand); free(s->pool); free(s->cand_z); free(s->cand_le); free(s->cand_lo);
    free(s->cand_s); free(s->masked); free(s->exact);
    free(s->dirty); free(s->dep); free(s->dirty_list);
    free(s);
}

void nvv_stale(nv_victim *s, int32_t layer) { mark_layer(s, layer); }

void nvv_hold(nv_victim *s, int32_t layer, const int32_t *restrict experts, int32_t n,
              int32_t delta) {
    int32_t *restrict holds = &s->holds[layer * s->n_expert];
    for (int32_t i = 0; i < n; i++) holds[experts[i]] += delta;
    mark_layer(s, layer);
}

void nvv_stale_all(nv_victim *s) {
    for (int32_t l = 0; l < s->n_layer; l++) s->list_vis[l] = -1;
    for (int32_t k = 0; k < s->n_moe; k++) mark(s, k);
}

void nvv_reset(nv_victim *s, const int32_t *pool_of_layer) {
    memset(s->members, 0, (size_t) s->n_layer * s->n_words * sizeof *s->members);
    memset(s->in_list, 0, (size_t) s->n_layer * s->n_expert);
    memset(s->list_n, 0, (size_t) s->n_layer * sizeof *s->list_n);
    s->one_pool = 1;
    for (int32_t k = 0; k < s->n_moe; k++) {
        s->pool[k] = pool_of_layer[s->moe_layers[k]];
        if (s->pool[k] != s->pool[0]) s->one_pool = 0;
    }
    nvv_stale_all(s);
}

/* -expected's lower bound of MoE index k's candidate (cand_s: from the upper bound of its
 * wait) and its upper bound, seen from the model's current layer (rounding is monotone: the
 * bounds hold for the doubles; distances() computes cand_s the same way) */
static inline void set_bounds(nv_victim *s, int32_t k) {
    s->cand_s[k] = -(nv_distance(s->nv, s->moe_layers[k]) + s->cand_le[k]);
}

static inline double minus_expected_hi(const nv_victim *s, int32_t k) {
    return -(nv_distance(s->nv, s->moe_layers[k]) + s->cand_lo[k]);
}

/* MoE index k's candidate's wait from nv_wait: its -expected exact */
static void make_exact(nv_victim *s, int32_t k) {
    const double le = (double) s->n_moe * nv_wait(s->nv, s->moe_layers[k], s->cand[k]);
    s->cand_le[k] = s->cand_lo[k] = le;
    s->exact[k] = 1;
    set_bounds(s, k);
}

/* MoE index k's lowest unprotected key (cand[k], its z, n_moe wait's bounds and
 * -expected's) */
static void find_candidate(nv_victim *s, int32_t k, int64_t seq0) {
    const int32_t layer = s->moe_layers[k];
    if (!list_valid(s, layer) && s->list_vis[layer] == s->nv->vis[layer])
        nvl_resort_list(s, layer);
    if (!list_valid(s, layer) || (s->list_n[layer] == 0 && !s->list_all[layer]))
        nvl_fill_list(s, layer);
    const int32_t *list = &s->list[layer * NV_LIST];
    int32_t f = -1;
    uint8_t dep = 0;
    for (int32_t i = 0; i < s->list_n[layer]; i++) {
        const int32_t g = list[i];
        if (s->holds[g]) continue;
        if (s->last_seq[g] >= seq0) { dep = 1; continue; }
        f = g;
        break;
    }
    if (f < 0 && !s->list_all[layer]) {          /* every listed key protected: scan */
        double bz = 0.0;
        FOR_MEMBERS(s, layer, g) {
            if (s->holds[g]) continue;
            if (s->last_seq[g] >= seq0) { dep = 1; continue; }
            const double z = nv_logit(s->nv, layer, g);
            if (z_below(s, z, g, bz, f)) { f = g; bz = z; }
        }
    }
    s->n_dep += (int32_t) dep - (int32_t) s->dep[k];
    s->dep[k] = dep;
    s->cand[k] = f;
    if (f >= 0) {
        double lo, hi;
        s->cand_z[k] = nv_logit(s->nv, layer, f);
        s->exact[k] = (uint8_t) nv_wait_bounds(s->nv, layer, f, &lo, &hi);
        s->cand_le[k] = (double) s->n_moe * hi;
        s->cand_lo[k] = (double) s->n_moe * lo;
        set_bounds(s, k);
    } else {
        s->cand_le[k] = s->cand_lo[k] = -INFINITY;   /* s = +inf: never the least */
        s->cand_s[k] = INFINITY;
        s->exact[k] = 1;
    }
}

/* s[k] = -(distance + le[k]) for MoE index k seen from MoE index ci (distance 1..L: k - ci,
 * plus L where that is <= 0; nv_distance); le -inf: s +inf */
__attribute__((optimize("tree-vectorize")))
static void distances(double *restrict s, const double *restrict le, int32_t L, int32_t ci) {
    const int32_t split = ci + 1 < L ? ci + 1 : L;
    for (int32_t k = 0; k < split; k++) s[k] = -((double) (k - ci + L) + le[k]);
    for (int32_t k = split; k < L; k++) s[k] = -((double) (k - ci) + le[k]);
}

/* v1 = the least of s[0 .. n), v2 = the least of the others (+inf if none): per lane a
 * min/max cascade (no branches), two lanes of two */
static void two_least(const double *s, int32_t n, double *v1, double *v2) {
    int32_t k = 0;
    double a1 = INFINITY, a2 = INFINITY;
#ifdef __SSE2__
    __m128d m1 = _mm_set1_pd(INFINITY), m2 = m1, n1 = m1, n2 = m1;
    for (; k + 4 <= n; k += 4) {
        const __m128d x = _mm_loadu_pd(&s[k]), y = _mm_loadu_pd(&s[k + 2]);
        m2 = _mm_min_pd(m2, _mm_max_pd(x, m1));
        m1 = _mm_min_pd(x, m1);
        n2 = _mm_min_pd(n2, _mm_max_pd(y, n1));
        n1 = _mm_min_pd(y, n1);
    }
    m2 = _mm_min_pd(_mm_max_pd(m1, n1), _mm_min_pd(m2, n2));   /* the two pairs as one */
    m1 = _mm_min_pd(m1, n1);
    const __m128d h1 = _mm_unpackhi_pd(m1, m1), h2 = _mm_unpackhi_pd(m2, m2);
    a2 = _mm_cvtsd_f64(_mm_min_sd(_mm_max_sd(m1, h1), _mm_min_sd(m2, h2)));
    a1 = _mm_cvtsd_f64(_mm_min_sd(m1, h1));
#endif
    for (; k < n; k++) {
        const double x = s[k];
        a2 = (x < a1 ? a1 : x) < a2 ? (x < a1 ? a1 : x) : a2;
        a1 = x < a1 ? x : a1;
    }
    *v1 = a1;
    *v2 = a2;
}

/* the first k with s[k] == v (one is) */
static int32_t first_at(const double *s, int32_t n, double v) {
    int32_t k = 0;
#ifdef __SSE2__
    const __m128d vv = _mm_set1_pd(v);
    for (; k + 2 <= n; k += 2) {
        const int mask = _mm_movemask_pd(_mm_cmpeq_pd(_mm_loadu_pd(&s[k]), vv));
        if (mask) return k + (mask & 1 ? 0 : 1);
    }
#endif
    for (; k < n; k++)
        if (s[k] == v) return k;
    return -1;
}

/* the pool's -expected lower bounds: cand_s itself with one pool, else a masked copy */
static const double *pool_bounds(nv_victim *s, int32_t pool) {
    if (s->one_pool) return s->cand_s;
    for (int32_t k = 0; k < s->n_moe; k++)
        s->masked[k] = s->pool[k] == pool ? s->cand_s[k] : INFINITY;
    return s->masked;
}

/* of the pool's candidates with -expected == bs (every one exact), the lowest in
 * (z, last seq, flat) */
static int32_t break_tie(const nv_victim *s, int32_t pool, double bs) {
    int32_t best = -1, bk = -1;
    for (int32_t k = 0; k < s->n_moe; k++) {
        if (s->cand_s[k] != bs) continue;
        const int32_t f = s->cand[k];
        if (f < 0 || s->pool[k] != pool) continue;
        if (best >= 0 && !z_below(s, s->cand_z[k], f, s->cand_z[bk], best)) continue;
        best = f; bk = k;
    }
    return best;
}

/* the pool's candidate least in (-expected, z, last seq, flat) from the bounds, each made
 * exact only while it is not yet apart: the least lower bound's candidate wins once its
 * upper bound is below every other's lower bound; exact and tied, the ties are made exact
 * too and broken by (z, last seq, flat). Every other candidate's -expected is above the
 * winner's, as the bounds show */
static int32_t pick(nv_victim *s, int32_t pool) {
    for (;;) {
        const double *lo = pool_bounds(s, pool);
        double v1, v2;
        two_least(lo, s->n_moe, &v1, &v2);
        if (v1 == INFINITY) return -1;
        const int32_t k = first_at(lo, s->n_moe, v1);
        if (minus_expected_hi(s, k) < v2) return s->cand[k];
        if (!s->exact[k]) {
            make_exact(s, k);
            continue;
        }
        int32_t n_made = 0;                       /* exact and tied (v2 == v1) */
        for (int32_t j = 0; j < s->n_moe; j++)
            if (lo[j] == v1 && !s->exact[j]) {
                make_exact(s, j);
                n_made++;
            }
        if (n_made == 0) return break_tie(s, pool, v1);
    }
}

int32_t nvv_lowest(nv_victim *s, int32_t pool, int64_t seq0) {
    if (s->nv->version != s->version) {           /* the weights moved: every score did */
        for (int32_t k = 0; k < s->n_moe; k++) mark(s, k);
        s->version = s->nv->version;
    }
    if (seq0 != s->seq0) {                        /* keys touched before seq0 are free now */
        if (s->n_dep > 0)
            for (int32_t k = 0; k < s->n_moe; k++)
                if (s->dep[k]) mark(s, k);
        s->seq0 = seq0;
    }
    for (int32_t i = 0; i < s->n_dirty; i++) {
        const int32_t k = s->dirty_list[i];
        find_candidate(s, k, seq0);
        s->dirty[k] = 0;
    }
    s->n_dirty = 0;
    if (s->nv->cur != s->s_cur) {                 /* every distance moved */
        const int32_t cur = s->nv->cur, ci = cur >= 0 ? s->nv->moe_index[cur] : -1;
        distances(s->cand_s, s->cand_le, s->n_moe, ci);
        s->s_cur = cur;
    }
    if (s->n_moe == 0 || (s->one_pool && s->pool[0] != pool)) return -1;
    return pick(s, pool);
}

/* the copies: each key's holds and each member's last seq are the core's (9, 10). Every
 * layer with a list: listed keys are members, in order, below every unlisted member, whose z
 * are >= the bound; list_all: no unlisted member. z from the features under the weights the
 * list's order is for (list_w). 0 ok, else the first failed check (nv_victim.h) */
int nvv_verify(const nv_victim *s, const int64_t *last_seq, const int32_t *lease_count,
               const uint8_t *pinned) {
    const nv_model *m = s->nv;
    for (int32_t f = 0; f < s->n_layer * s->n_expert; f++) {     /* the copies */
        if (s->holds[f] != lease_count[f] + pinned[f]) return 9;
        if (is_member(s, f) && s->last_seq[f] != last_seq[f]) return 10;
    }
    if (s->list[s->n_layer * NV_LIST] != -1) return 7;          /* a list overran */
    for (int32_t k = 0; k < s->n_moe && s->version == m->version; k++) {
        const int32_t layer = s->moe_layers[k], f = s->cand[k];  /* the wait's bounds hold */
        if (f < 0 || s->dirty[k] || m->e_stamp[f] != nv_stamp(m, layer)) continue;
        const double le = (double) s->n_moe * nv_roll(m, layer, f);
        if (!(s->cand_lo[k] <= le && le <= s->cand_le[k])) return 8;
        if (s->exact[k] && s->cand_lo[k] != s->cand_le[k]) return 8;
    }
    for (int32_t k = 0; k < s->n_moe; k++) {
        const int32_t layer = s->moe_layers[k];
        if (s->list_vis[layer] != m->vis[layer]) continue;       /* refilled before use */
        const double *wb = &s->list_w[layer * NV_F];
        const int32_t *list = &s->list[layer * NV_LIST];
        const int32_t n = s->list_n[layer];
        double lz[NV_LIST];
        for (int32_t i = 0; i < n; i++) {
            const int32_t g = list[i];
            if (g / s->n_expert != layer || !is_member(s, g)) return 1;
            double x[NV_F];
            nv_features(m, layer, g, x);
            lz[i] = nv_dot(wb, x);
            if (i > 0 && !z_below(s, lz[i - 1], list[i - 1], lz[i], g)) return 2;
            if (!s->in_list[g]) return 6;
        }
        FOR_MEMBERS(s, layer, g) {
            int32_t listed = 0;
            for (int32_t i = 0; i < n; i++) listed |= list[i] == g;
            if (listed) continue;
            if (s->in_list[g]) return 6;
            if (s->list_all[layer]) return 3;
            double x[NV_F];
            nv_features(m, layer, g, x);
            const double z = nv_dot(wb, x);
            if (z < s->list_bound[layer]) return 4;
            if (n > 0 && !z_below(s, lz[n - 1], list[n - 1], z, g)) return 5;
        }
    }
    return 0;
}
