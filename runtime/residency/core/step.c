/* step: one consumer's layer-step on a residency core (residency_core.h: rc_step). The one
 * implementation of "lease this layer's experts, end the previous layer's lease, decide":
 * the routing hook's bookkeeping (route_hook.c), the device cache (device_cache.c), the RAM
 * tier (layer_step.c) and rc_bench_live (below: a benchmark's loop of steps, beside the step
 * it times) all step through it. It calls only the entry points (api.c): the step is above
 * them, never called by them.
 *
 * Invariant: a consumer holds at most one lease per core, its latest layer-step's (the graph
 * runs layers in order, so the previous layer's matmuls are done when the next one routes). */
#include "residency_core.h"

#include <stdio.h>

int rc_step(rc_core *c, int64_t *held, int32_t layer, const int32_t *experts, int32_t n,
            int32_t phase, rc_result *out) {
    const int64_t lease = rc_lease_id(c);
    const int rc = rc_access(c, layer, experts, n, phase, NULL, -1, NULL, NULL, 0, lease, *held,
                             out);
    *held = rc == RC_OK ? lease : 0;      /* the previous lease ended either way */
    return rc;
}

void rc_step_end(rc_core *c, int64_t *held) {
    if (*held) rc_release(c, *held);
    *held = 0;
}

void rc_step_message(char *buf, int32_t cap, const char *who, int32_t layer, int status) {
    snprintf(buf, (size_t) cap, "%sthe residency core refused layer %d (status %d)", who, layer,
             status);
}

int64_t rc_bench_live(rc_core *c, int64_t n_steps, const int32_t *layers, const int32_t *experts,
                      int32_t k, int32_t phase) {
    rc_result r;
    int64_t held = 0, hits = 0;
    for (int64_t i = 0; i < n_steps; i++) {
        const int rc = rc_step(c, &held, layers[i], experts + i * k, k, phase, &r);
        if (rc != 0) return rc;
        hits += r.hits;
    }
    rc_step_end(c, &held);
    return hits;
}
