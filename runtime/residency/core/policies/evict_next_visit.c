/* next-visit: -(expected layer-steps to the next use) from its model (next_visit.h); its
 * scores move with the layer cycle, so its order is its own index (order.c's
 * rc_next_visit_order, nv_victim.h), and a planner's own expected times rank against it
 * (eviction.NextVisit). */
#include "../core_impl.h"

static double score(const rc_core *c, int32_t o, int32_t f) {
    (void) o;
    return -nv_expected(c->nv, f);
}

RC_EVICTION_POLICY(next_visit, "next-visit", .ops = &rc_next_visit_order, .score = score,
                   .planned_scores = 1);
