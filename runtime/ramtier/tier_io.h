/* tier_io: the RAM tier's per-layer work in C (runtime/ramtier/tier.py owns it from Python).
 *
 * Per MoE layer-step (rt_step, called by the routing hook's native mode in route_hook.c, or by
 * RamTier.on_route in the reference hook, hook/reference.py): the residency core of device "cpu"
 * decides (rc_access, inline: admissions are resident at once); the layer's experts whose pages
 * are not in the page cache (admissions, transient uses, hits the kernel reclaimed: a one-page
 * mincore probe per layer-step, then mincore over the hits' ranges) are queued on the reader
 * (reader.h: explicit preads, several in flight, demand before prefetch). With the matmul hook
 * on (rt_set_async: ggml's MUL_MAT_ID asks rt_weight_ready per expert matrix, llamacpp/patches/
 * 0007) rt_step returns at once: the matmul computes the layer's resident experts while the
 * others come in, and waits for each of those just before it reads it. Without it rt_step
 * returns when every byte is in. Before it queues any read, a step with a one-use room
 * (rt_set_one_use_room) waits until its transient uses and the queued drops fit that room, so
 * the page cache holds no more than the core's capacity + the room. Evicted experts' pages
 * leave every mapping and the page cache
 * (MADV_DONTNEED, then posix_fadvise(DONTNEED)) on the tier's drop thread, except pages a held,
 * busy or running expert shares (checked when the drop runs; a key read or used again before
 * its queued drop runs keeps its pages). A failed read (EIO, a short read: the file was truncated) fails the layer-step or,
 * found by the matmul, the batch (rt_batch_end): rt_error says which.
 *
 * Shared state, owned by Python (numpy arrays, one byte per flat key = layer * n_expert + e):
 *   held[f]  1 while f's pages were read in and the core holds f resident. Written by rt_step
 *            (the decode thread) and by Python (a background read finished; at batch end).
 *   busy[f]  1 while a background read of f runs (a ticket on Python's lane). rt_step never
 *            drops a busy key's pages (it clears held[f]; the read's completion then drops
 *            them) and reads a busy key the layer needs itself.
 * Prefetches the core issues in a step are queued at once behind the demand reads; a
 * prefetched key's first use waits for what is still coming. Everything else (the events:
 * admissions, drops, the first layer whose hits were reclaimed) is drained by Python once per
 * batch (rt_events / rt_clear_events).
 *
 *     rt_tier *t = rt_create(core, n_layer, n_expert, range_start, range_off, range_len,
 *                            edge_start, edge_owner, edge_full, held, busy, fd, threads);
 *     rt_set_regions(t, n, file_off, length, addr, copy);     // the model's mappings
 *     rt_set_async(t, 1);                                     // ggml's hook: rt_weight_ready
 *     ... rt_step(t, layer, experts, n, phase) per layer-step; rt_batch_end(t) per batch ...
 *     rt_free(t);
 */
#ifndef TIER_IO_H
#define TIER_IO_H
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

typedef struct rt_tier rt_tier;

typedef struct {
    int64_t routes;            /* layer-steps */
    int64_t paged_bytes;       /* queued by the steps: admissions, transients, reclaimed */
    int64_t reclaimed_bytes;   /* part of the above: hits the kernel had dropped */
    int64_t wait_ns;           /* wall time a thread waited for reads (step or matmul) */
    int64_t dropped;           /* experts whose pages were dropped (evictions) */
    int64_t reads;             /* ranges queued */
    int64_t prefetched_bytes;  /* the core's prefetches: reads queued behind the demand */
    int64_t step_ns;           /* time in rt_step (decisions, queueing, synchronous waits) */
    int64_t read_bytes;        /* bytes read from the file (reader.h) */
    int64_t ready_bytes;       /* bytes of ranges already read when first needed */
    int64_t late_bytes;        /* bytes of ranges still coming when first needed */
    int64_t waits;             /* waits that found a range incomplete */
    int64_t drop_wait_ns;      /* time steps spent on queued drops (running them or waiting
                                  for the drop thread) to keep within the one-use room */
    int64_t one_use_peak;      /* most bytes of one-use reads + queued drops at a read */
} rt_stats;

enum { RT_EV_ADMIT = 1, RT_EV_DROP = 2 };

/* range_start (n_flat + 1): flat f's file ranges are [range_start[f], range_start[f + 1]) of
 * range_off / range_len (bytes). Edges: for range r, edge 2r is its first page, 2r + 1 its
 * last; edge_start (2 n_ranges + 1) indexes edge_owner (flat keys with bytes in that page);
 * edge_full[e] is 1 when expert bytes cover the whole page (no dense bytes share it).
 * held / busy (n_flat) stay owned by the caller; fd: the model file, read-only. */
rt_tier *rt_create(void *core, int32_t n_layer, int32_t n_expert, const int64_t *range_start,
                   const int64_t *range_off, const int64_t *range_len, const int64_t *edge_start,
                   const int32_t *edge_owner, const uint8_t *edge_full, uint8_t *held,
                   uint8_t *busy, int32_t fd, int32_t threads);
void rt_free(rt_tier *t);
/* the mappings of the file: n regions (file offset, bytes, address, copy; copy 0 is the one
 * reads and mincore use, every copy is unmapped on drop) */
int rt_set_regions(rt_tier *t, int32_t n, const int64_t *file_off, const int64_t *length,
                   const int64_t *addr, const int32_t *copy);
void rt_set_fd(rt_tier *t, int32_t fd);
/* bytes per read request: at most what the model's disk takes in one (max_sectors_kb) */
void rt_set_read_chunk(rt_tier *t, int64_t bytes);
void rt_set_mlock(rt_tier *t, int32_t on);   /* munlock before a drop */
/* the budget's room for pages the core does not count (bytes; -1, the default: no bound).
 * The core keeps at most its capacity; beyond it the page cache holds a layer-step's transient
 * uses (read for one matmul, not kept) and the pages of evicted / finished keys whose drop is
 * still queued. With a room set, a layer-step queues no read while those two together would
 * pass it: it first waits for the drop thread. The caller sizes the room to hold one layer's
 * every expert (the most one layer-step can use once), so capacity + room <= the budget holds
 * throughout (runtime/ramtier/__init__.py, one_use_room). */
void rt_set_one_use_room(rt_tier *t, int64_t bytes);

int rt_step(rt_tier *t, int32_t layer, const int32_t *experts, int32_t n, int32_t phase);
/* the lease ends, transient pages leave; -1 when a read failed in the batch (rt_error) */
int rt_batch_end(rt_tier *t);
/* 1: rt_step only queues the reads and the matmul waits per expert matrix (ggml's weight-ready
 * hook must call rt_weight_ready: the caller installs it); 0: rt_step waits. 0, or -1 (too
 * many tiers in this process: it stays synchronous) */
int rt_set_async(rt_tier *t, int32_t on);
/* ggml_cpu_weight_ready_t (llamacpp/patches/0007): `data` inside an expert range of a tier with
 * rt_set_async(1)? !wait: whether its bytes are in (its first use is counted ready or late);
 * wait: return once they are. Any other address is ready. */
bool rt_weight_ready(const void *data, size_t size, bool wait, void *user_data);
const char *rt_error(const rt_tier *t);

/* the page-aligned ranges of flat's pages no held, busy or running expert shares; their
 * number (at most cap are written) */
int32_t rt_droppable(const rt_tier *t, int32_t flat, int64_t *off, int64_t *len, int32_t cap);
int64_t rt_drop(rt_tier *t, int32_t flat);   /* drop those pages now; bytes */
/* evictions and transient uses leave on the tier's drop thread (fadvise(DONTNEED) waits for
 * every CPU): the bytes of the keys whose drop is queued or running (an upper bound), and a
 * wait until none is */
int64_t rt_pending_drop_bytes(rt_tier *t);
void rt_drain_drops(rt_tier *t);
/* read file ranges into the page cache on this thread (explicit preads); 0, or -1 (rt_error) */
int rt_page_in(rt_tier *t, const int64_t *off, const int64_t *len, int32_t n);

void rt_get_stats(const rt_tier *t, rt_stats *out);
int32_t rt_n_events(const rt_tier *t);
/* events since the last clear: kind[i] (RT_EV_*), flat[i] */
int rt_events(const rt_tier *t, int32_t *kind, int32_t *flat);
void rt_clear_events(rt_tier *t);
int32_t rt_reclaimed_layer(const rt_tier *t);   /* first layer with reclaimed hits, or -1 */
/* a rare event: called (on the decoding thread, before the layer's reads) at the first layer of
 * a batch whose hits the kernel reclaimed, so that a cold page cache can start the refill */
typedef void (*rt_reclaim_cb)(int32_t layer, void *user_data);
void rt_set_on_reclaim(rt_tier *t, rt_reclaim_cb cb, void *user_data);

#endif
