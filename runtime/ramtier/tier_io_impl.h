/* tier_io_impl.h: the RAM tier's per-layer work, its private struct and the calls between its
 * files (internal to the RAM tier; the public API is tier_io.h):
 *   tier_io.c       lifetime (rt_create, rt_free), settings, stats
 *   layer_step.c    rt_step and rt_batch_end: the core's decisions, the reads, the events
 *   drops.c         which pages may leave and the drop thread (rt_drop_later, rt_cancel_drop)
 *   weight_ready.c  the matmul's per-expert wait (rt_weight_ready) and the tiers it looks up
 * Calls go one way: tier_io.c and layer_step.c call drops.c and weight_ready.c, never back. */
#ifndef TIER_IO_IMPL_H
#define TIER_IO_IMPL_H
#include "tier_io.h"
#include "file_pages.h"
#include "reader.h"
#include "../residency/core/residency_core.h"

#include <pthread.h>

struct rt_tier {
    rc_core *core;
    int32_t n_layer, n_expert, n_flat, threads, mlock;
    fp_file *file;                 /* the model file: mapping, mincore, drops */
    rd_reader *reader;             /* its reads: job r is range r */
    int32_t async;                 /* the matmul waits per expert matrix (rt_weight_ready) */
    int32_t n_ranges;
    int32_t *by_off;               /* (n_ranges,) range ids sorted by file offset */
    int failed;                    /* a read failed in this batch (reported at its end) */
    /* drops, on their own thread: fadvise(DONTNEED) drains every CPU's page batches (hundreds
     * of microseconds, more on a busy machine), which the decode must not wait for */
    pthread_t drop_thread;
    int drop_started, drop_stop;
    pthread_mutex_t drop_mu;
    pthread_cond_t drop_cv, drop_idle;
    int32_t *drop_ring, drop_head, drop_n;   /* flat keys, FIFO (n_flat slots) */
    uint8_t *drop_pending;                   /* (n_flat) queued and not cancelled */
    int32_t dropping;                        /* the key the drop thread drops now, or -1 */
    int32_t helping;                         /* the key a step over its room drops, or -1 */
    int64_t drop_bytes;                      /* bytes of the keys queued (an upper bound) */
    int64_t page;
    const int64_t *range_start, *range_off, *range_len, *edge_start;
    const int32_t *edge_owner;
    const uint8_t *edge_full;
    uint8_t *held, *busy;
    uint8_t *cur;                  /* (n_flat,) in use by the running layer-step */
    uint8_t *mark;                 /* (n_flat,) scratch: 1 admitted, 2 transient */
    uint8_t *advised;              /* (n_flat,) prefetched: reads queued, not yet used */
    int32_t *cur_list, n_cur;      /* the running layer-step's keys */
    int32_t *transient, n_transient;
    int32_t *pf_list, n_pf;        /* the layer-step's prefetches, read once there is room */
    int64_t one_use_room;          /* rt_set_one_use_room: bytes, or -1 (no bound) */
    int64_t lease;                 /* the core's lease of the last layer-step (rc_step) */
    int64_t *want_off, *want_len; int32_t n_want;   /* this layer-step's reads */
    int64_t cap_want;
    /* events and counters */
    int32_t *ev_kind, *ev_flat, n_ev;
    int64_t cap_ev;
    int32_t reclaimed_layer;
    rt_reclaim_cb on_reclaim; void *on_reclaim_user;
    rt_stats stats;
    char msg[256];
};

/* drops.c: key f's pages are to leave (queued on the drop thread), or stay after all */
void rt_drop_later(rt_tier *t, int32_t f);
void rt_cancel_drop(rt_tier *t, int32_t f);
/* drops.c: start the drop thread (rt_create; without one, drops run at once), and stop it
 * after the queued drops ran (rt_free) */
void rt_drops_start(rt_tier *t);
void rt_drops_stop(rt_tier *t);
/* drops.c: the bytes of key f's ranges */
int64_t rt_key_bytes(const rt_tier *t, int32_t f);
/* drops.c: before a layer-step reads, until the queued drops + its `one_use` bytes of
 * transient uses fit the one-use room, run queued drops on this thread or wait for the drop
 * thread's (counted in stats.drop_wait_ns, stats.one_use_peak) */
void rt_make_room(rt_tier *t, int64_t one_use);
/* weight_ready.c: by_off, the ranges sorted by file offset (rt_create) */
void rt_sort_ranges(rt_tier *t);

#endif
