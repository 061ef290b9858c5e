/* nv_victim's private parts, shared by nv_victim.c (the candidates and the victim) and
 * nv_lists.c (each layer's list of its lowest keys, the membership bitmap), which calls
 * nothing of nv_victim.c: what both need is here. */
#ifndef NV_VICTIM_IMPL_H
#define NV_VICTIM_IMPL_H
#include "nv_victim.h"

/* (z, last seq, flat) of a below b (b -1: none) */
static inline int z_below(const nv_victim *s, double za, int32_t a, double zb, int32_t b) {
    if (b < 0) return 1;
    if (za != zb) return za < zb;
    if (s->last_seq[a] != s->last_seq[b]) return s->last_seq[a] < s->last_seq[b];
    return a < b;
}

/* f is in the order */
static inline int is_member(const nv_victim *s, int32_t f) {
    const int32_t l = f / s->n_expert, e = f - l * s->n_expert;
    return (int) (s->members[l * s->n_words + e / 64] >> (e % 64) & 1);
}

static inline int list_valid(const nv_victim *s, int32_t l) {
    return s->list_vis[l] == s->nv->vis[l] && s->list_ver[l] == s->nv->version;
}

/* MoE index k's candidate is dirty (found again on the next search) */
static inline void mark(nv_victim *s, int32_t k) {
    if (s->dirty[k]) return;
    s->dirty[k] = 1;
    s->dirty_list[s->n_dirty++] = k;
}

/* the layer's candidate is dirty (nvv_stale; a key joined or left, a hold changed) */
static inline void mark_layer(nv_victim *s, int32_t layer) {
    const int32_t k = s->nv->moe_index[layer];
    if (k >= 0) mark(s, k);
}

/* for each key g of the layer in the order (its bitmap), in flat order */
#define FOR_MEMBERS(s, layer, g)                                                              \
    for (int32_t w_ = 0; w_ < (s)->n_words; w_++)                                            \
        for (uint64_t b_ = (s)->members[(layer) * (s)->n_words + w_]; b_; b_ &= b_ - 1)     \
            for (int32_t g = (layer) * (s)->n_expert + w_ * 64 + __builtin_ctzll(b_), o_ = 1; \
                 o_; o_ = 0)

/* the layer's list refilled from its members (every member scored) / re-sorted after a
 * weight update (its listed keys rescored; those still below the bound stay) */
void nvl_fill_list(nv_victim *s, int32_t layer);
void nvl_resort_list(nv_victim *s, int32_t layer);

#endif
