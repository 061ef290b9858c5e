/* leases: the holds that protect keys from eviction (core_impl.h). A key is held while it is
 * leased (a consumer's layer-step, until released) or pinned (prefetched, until its layer's
 * next access); every flip of (lease_count > 0 || pinned) reaches the orders through
 * order_hold, here and nowhere else. */
#include "core_impl.h"

#include <stdlib.h>
#include <string.h>

/* keys of one layer whose hold flipped the same way, told to the orders in batches (no
 * allocation; f is not initialized: only f[0 .. n) is read) */
typedef struct { int32_t f[64]; int32_t n, held, layer; } flips;

static inline void flush(rc_core *c, flips *b) {
    if (b->n) order_hold(c, b->layer, b->f, b->n, b->held);
    b->n = 0;
}

static inline void flipped(rc_core *c, flips *b, int32_t f) {
    b->f[b->n++] = f;
    if (b->n == (int32_t) (sizeof b->f / sizeof *b->f)) flush(c, b);
}

/* ---- leases ---------------------------------------------------------------------------- */

int take_lease(rc_core *c, int64_t id, int32_t base, const int32_t *experts, int32_t n) {
    if (c->n_leases == c->cap_leases) {
        int32_t cap = c->cap_leases ? 2 * c->cap_leases : 8;
        lease *v = realloc(c->leases, (size_t) cap * sizeof *v);
        if (v == NULL) return -1;
        c->leases = v; c->cap_leases = cap;
    }
    lease *l = &c->leases[c->n_leases];
    l->experts = malloc((size_t) (n ? n : 1) * sizeof *l->experts);
    if (l->experts == NULL) return -1;
    memcpy(l->experts, experts, (size_t) n * sizeof *experts);
    l->id = id; l->base = base; l->n = n;
    flips b;
    b.n = 0, b.held = 1, b.layer = base / c->n_expert;
    for (int32_t i = 0; i < n; i++) {
        const int32_t f = base + experts[i];
        if (c->lease_count[f]++ == 0 && !c->pinned[f]) flipped(c, &b, f);
    }
    flush(c, &b);
    c->n_leases++;
    return 0;
}

void core_release(rc_core *c, int64_t lease_id) {
    for (int32_t i = 0; i < c->n_leases; i++) {
        lease *l = &c->leases[i];
        if (l->id != lease_id) continue;
        flips b;
        b.n = 0, b.held = 0, b.layer = l->base / c->n_expert;
        for (int32_t j = 0; j < l->n; j++) {
            const int32_t f = l->base + l->experts[j];
            if (--c->lease_count[f] == 0 && !c->pinned[f]) flipped(c, &b, f);
        }
        flush(c, &b);
        free(l->experts);
        *l = c->leases[--c->n_leases];
        return;
    }
}

/* ---- prefetch pins -------------------------------------------------------------------- */

int pin_key(rc_core *c, int32_t f) {
    if (!c->pinned[f]) {
        c->pinned[f] = 1;
        if (c->lease_count[f] == 0) order_hold(c, f / c->n_expert, &f, 1, 1);
    }
    return ivec_push(&c->pins_by_layer[f / c->n_expert], f);
}

/* the layer's prefetch pins end (its access) */
void unpin_layer(rc_core *c, int32_t layer) {
    ivec *pins = &c->pins_by_layer[layer];
    flips b;
    b.n = 0, b.held = 0, b.layer = layer;
    for (int32_t i = 0; i < pins->n; i++) {
        const int32_t f = pins->v[i];
        if (!c->pinned[f]) continue;
        c->pinned[f] = 0;
        if (c->lease_count[f] == 0) flipped(c, &b, f);
    }
    flush(c, &b);
    pins->n = 0;
}
