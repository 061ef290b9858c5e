/* tier_io: see tier_io.h (and tier_io_impl.h for how its files divide the work): the tier's
 * lifetime, its settings and its stats. */
#include "tier_io_impl.h"

#include <stdlib.h>

/* ---- the mappings ---------------------------------------------------------------------- */

int rt_set_regions(rt_tier *t, int32_t n, const int64_t *file_off, const int64_t *length,
                   const int64_t *addr, const int32_t *copy) {
    return fp_set_regions(t->file, n, file_off, length, addr, copy);
}

const char *rt_error(const rt_tier *t) { return t->msg; }
void rt_get_stats(const rt_tier *t, rt_stats *out) {
    *out = t->stats;
    rd_stats rs;
    rd_get_stats(t->reader, &rs);
    out->read_bytes = rs.read_bytes;
    out->ready_bytes = rs.ready_bytes;
    out->late_bytes = rs.late_bytes;
    out->wait_ns = rs.wait_ns;
    out->waits = rs.waits;
}
void rt_set_fd(rt_tier *t, int32_t fd) { fp_set_fd(t->file, fd); rd_set_fd(t->reader, fd); }
void rt_set_read_chunk(rt_tier *t, int64_t bytes) { rd_set_chunk(t->reader, bytes); }
void rt_set_mlock(rt_tier *t, int32_t on) { t->mlock = on; }
void rt_set_one_use_room(rt_tier *t, int64_t bytes) { t->one_use_room = bytes < 0 ? -1 : bytes; }
void rt_set_on_reclaim(rt_tier *t, rt_reclaim_cb cb, void *user_data) {
    t->on_reclaim = cb;
    t->on_reclaim_user = user_data;
}

/* ---- lifetime -------------------------------------------------------------------------- */

rt_tier *rt_create(void *core, int32_t n_layer, int32_t n_expert, const int64_t *range_start,
                   const int64_t *range_off, const int64_t *range_len, const int64_t *edge_start,
                   const int32_t *edge_owner, const uint8_t *edge_full, uint8_t *held,
                   uint8_t *busy, int32_t fd, int32_t threads) {
    if (threads < 1 || n_layer < 1 || n_expert < 1) return NULL;
    rt_tier *t = calloc(1, sizeof *t);
    if (t == NULL) return NULL;
    t->core = core; t->n_layer = n_layer; t->n_expert = n_expert;
    t->n_flat = n_layer * n_expert; t->threads = threads;
    t->range_start = range_start; t->range_off = range_off; t->range_len = range_len;
    t->edge_start = edge_start; t->edge_owner = edge_owner; t->edge_full = edge_full;
    t->held = held; t->busy = busy;
    t->reclaimed_layer = -1;
    t->n_ranges = (int32_t) range_start[t->n_flat];
    t->file = fp_create(fd);
    t->reader = t->file ? rd_create(t->file, fd, threads, t->n_ranges, range_off, range_len)
                        : NULL;
    t->cur = calloc((size_t) t->n_flat, 1);
    t->mark = calloc((size_t) t->n_flat, 1);
    t->advised = calloc((size_t) t->n_flat, 1);
    t->cur_list = malloc((size_t) t->n_flat * sizeof *t->cur_list);
    t->transient = malloc((size_t) t->n_flat * sizeof *t->transient);
    t->pf_list = malloc((size_t) t->n_flat * sizeof *t->pf_list);
    t->one_use_room = -1;
    t->by_off = malloc((size_t) (t->n_ranges ? t->n_ranges : 1) * sizeof *t->by_off);
    if (!t->file || !t->reader || !t->cur || !t->mark || !t->advised || !t->cur_list ||
        !t->transient || !t->pf_list || !t->by_off) {
        rt_free(t);
        return NULL;
    }
    rt_sort_ranges(t);
    t->page = fp_page_size(t->file);
    rt_drops_start(t);
    return t;
}

void rt_free(rt_tier *t) {
    if (t == NULL) return;
    rt_set_async(t, 0);                      /* no matmul looks this tier up any more */
    rt_drops_stop(t);
    rd_free(t->reader);
    fp_free(t->file);
    free(t->cur); free(t->mark); free(t->advised); free(t->cur_list); free(t->transient);
    free(t->pf_list);
    free(t->by_off);
    free(t->want_off); free(t->want_len); free(t->ev_kind); free(t->ev_flat);
    free(t);
}
