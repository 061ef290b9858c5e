/* verify: rc_verify, every bookkeeping invariant of the residency core (tests, debugging;
 * O(keys)). Returns 0, or the number of the first check that failed:
 *   1 a resident key is missing from an order      2 a key not resident is ordered
 *   3 a pool's resident bytes or count disagree     5 a pool holds more than its capacity
 *   6 an order's structure is broken                8 a negative lease count
 *  10 the prefetched-unused count disagrees        11 next-visit's index (nv_victim.h)
 *  12 next-visit's index's copies (a key's holds, a member's last seq) are not the core's
 */
#include "core_impl.h"

int core_verify(const rc_core *c) {
    for (int32_t pi = 0; pi < c->n_pool; pi++) {
        const pool *p = &c->pools[pi];
        int64_t bytes = 0, count = 0;
        for (int32_t f = 0; f < c->n_flat; f++) {
            if (c->pool_of_layer[f / c->n_expert] != pi) continue;
            const int resident = c->state[f] <= RESIDENT_MAX;
            if (resident) {
                bytes += c->bytes_flat[f];
                count++;
            }
            for (int32_t o = 0; o < c->pol.n_orders; o++)
                if ((p->h[o].pos[f] >= 0) != resident) return resident ? 1 : 2;
        }
        if (bytes != p->resident_bytes || count != p->resident_count) return 3;
        if (p->capacity < 0 ? bytes != 0 : bytes > p->capacity) return 5;
    }
    int64_t n_pf = 0;
    for (int32_t f = 0; f < c->n_flat; f++) {
        n_pf += c->pf_unused[f];
        if (c->lease_count[f] < 0) return 8;
    }
    if (n_pf != c->n_pf_unused) return 10;
    return order_verify(c);
}
