/* leases: the holds that protect keys from eviction (core_impl.h). A key is held while it is
 * leased (a consumer's layer-step, until released) or pinned (prefetched, until its layer's
 * next access): lease_count[f] + pinned[f] > 0. Every hold taken or ended reaches the orders
 * through order_hold, here and nowhere else. */
#include "core_impl.h"

#include <stdlib.h>
#include <string.h>

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
    for (int32_t i = 0; i < n; i++) c->lease_count[base + experts[i]]++;
    order_hold(c, base / c->n_expert, experts, n, 1);
    c->n_leases++;
    return 0;
}

void core_release(rc_core *c, int64_t lease_id) {
    for (int32_t i = 0; i < c->n_leases; i++) {
        lease *l = &c->leases[i];
        if (l->id != lease_id) continue;
        for (int32_t j = 0; j < l->n; j++) c->lease_count[l->base + l->experts[j]]--;
        order_hold(c, l->base / c->n_expert, l->experts, l->n, -1);
        free(l->experts);
        *l = c->leases[--c->n_leases];
        return;
    }
}

/* ---- prefetch pins -------------------------------------------------------------------- */

int pin_key(rc_core *c, int32_t f) {
    const int32_t layer = f / c->n_expert, e = f - layer * c->n_expert;
    if (!c->pinned[f]) {
        c->pinned[f] = 1;
        order_hold(c, layer, &e, 1, 1);
    }
    return ivec_push(&c->pins_by_layer[layer], f);
}

/* the layer's prefetch pins end (its access); their experts are gathered in place */
void unpin_layer(rc_core *c, int32_t layer) {
    ivec *pins = &c->pins_by_layer[layer];
    const int32_t base = layer * c->n_expert;
    int32_t m = 0;
    for (int32_t i = 0; i < pins->n; i++) {
        const int32_t f = pins->v[i];
        if (!c->pinned[f]) continue;
        c->pinned[f] = 0;
        pins->v[m++] = f - base;
    }
    if (m) order_hold(c, layer, pins->v, m, -1);
    pins->n = 0;
}
