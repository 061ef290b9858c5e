/* lfu: evict the key routed least often over the device's whole history (eviction.Lfu). */
#include "../core_impl.h"

static double score(const rc_core *c, int32_t o, int32_t f) {
    (void) o;
    return (double) total_uses(c, f);
}

RC_EVICTION_POLICY(lfu, "lfu", .ops = &rc_heap_order, .score = score);
