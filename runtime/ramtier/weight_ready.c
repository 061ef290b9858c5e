/* weight_ready: the matmul's hook (ggml_cpu_set_weight_ready: llamacpp/patches/0007): with
 * rt_set_async(1), ggml's MUL_MAT_ID asks rt_weight_ready per expert matrix whether its bytes
 * are in, and waits for them before it reads them. */
#include "tier_io_impl.h"

#include <stdlib.h>

/* the tiers whose matmuls wait per expert matrix (one per model in this process) */
#define MAX_TIERS 16
static rt_tier *g_tiers[MAX_TIERS];
static pthread_rwlock_t g_tiers_lock = PTHREAD_RWLOCK_INITIALIZER;

/* the range of tier t whose bytes start at file offset `off`, or -1 */
static int32_t range_at(const rt_tier *t, int64_t off) {
    int32_t lo = 0, hi = t->n_ranges - 1;
    while (lo <= hi) {
        const int32_t mid = (lo + hi) / 2, r = t->by_off[mid];
        if (t->range_off[r] == off) return r;
        if (t->range_off[r] < off) lo = mid + 1;
        else hi = mid - 1;
    }
    return -1;
}

bool rt_weight_ready(const void *data, size_t size, bool wait, void *user_data) {
    (void) size; (void) user_data;
    bool ready = true;
    pthread_rwlock_rdlock(&g_tiers_lock);
    for (int32_t i = 0; i < MAX_TIERS; i++) {
        rt_tier *t = g_tiers[i];
        if (t == NULL) continue;
        const int64_t off = fp_offset_of(t->file, data);
        if (off < 0) continue;
        const int32_t r = range_at(t, off);
        if (r < 0) break;                     /* not an expert range of this tier's */
        if (!wait) ready = rd_use(t->reader, r);
        else if (rd_wait(t->reader, r) != 0) t->failed = 1;   /* reported at the step/end */
        break;
    }
    pthread_rwlock_unlock(&g_tiers_lock);
    return ready;
}

int rt_set_async(rt_tier *t, int32_t on) {
    pthread_rwlock_wrlock(&g_tiers_lock);
    int rc = 0, at = -1;
    for (int32_t i = 0; i < MAX_TIERS; i++) {
        if (g_tiers[i] == t) at = i;
    }
    if (on && at < 0) {
        for (int32_t i = 0; i < MAX_TIERS && at < 0; i++)
            if (g_tiers[i] == NULL) { g_tiers[i] = t; at = i; }
        if (at < 0) rc = -1;                  /* full: this tier stays synchronous */
    } else if (!on && at >= 0) {
        g_tiers[at] = NULL;
    }
    t->async = on && rc == 0;
    pthread_rwlock_unlock(&g_tiers_lock);
    return rc;
}

static const rt_tier *g_sort_tier;       /* qsort's context (rt_create, under no lock) */
static int by_offset(const void *a, const void *b) {
    const int64_t x = g_sort_tier->range_off[*(const int32_t *) a];
    const int64_t y = g_sort_tier->range_off[*(const int32_t *) b];
    return x < y ? -1 : x > y;
}

void rt_sort_ranges(rt_tier *t) {
    for (int32_t r = 0; r < t->n_ranges; r++) t->by_off[r] = r;
    pthread_rwlock_wrlock(&g_tiers_lock);    /* qsort has no context argument */
    g_sort_tier = t;
    qsort(t->by_off, (size_t) t->n_ranges, sizeof *t->by_off, by_offset);
    g_sort_tier = NULL;
    pthread_rwlock_unlock(&g_tiers_lock);
}
