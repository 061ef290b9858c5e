/* belady (offline): evict the key used again last (eviction.Belady). */
#include "../core_impl.h"

static double score(const rc_core *c, int32_t o, int32_t f) {
    (void) o;
    return -(double) c->next_use[f];
}

RC_EVICTION_POLICY(belady, "belady", .ops = &rc_heap_order, .score = score);
