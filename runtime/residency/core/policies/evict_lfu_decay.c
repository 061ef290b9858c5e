/* lfu-decay: evict the key of the lowest exponentially decayed use count, kept by the core
 * as a log (c->decay_log, rate pol.decay_rate; eviction.LfuDecay). */
#include "../core_impl.h"

static double score(const rc_core *c, int32_t o, int32_t f) {
    (void) o;
    return c->decay_log[f];
}

RC_EVICTION_POLICY(lfu_decay, "lfu-decay", .ops = &rc_heap_order, .score = score);
