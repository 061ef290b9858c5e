/* lru: evict the least recently accessed key (eviction.Lru is its Python reference). */
#include "../core_impl.h"

static double score(const rc_core *c, int32_t o, int32_t f) {
    (void) o;
    return (double) c->last_seq[f];
}

RC_EVICTION_POLICY(lru, "lru", .ops = &rc_heap_order, .score = score, .score_is_last_seq = 1);
