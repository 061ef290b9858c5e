/* tier_io: see tier_io.h. The Python references of the same rules: ExpertLayout.droppable
 * (runtime/ramtier/layout.py) for which pages may leave, Pager.page_in (pager.py) for the
 * reads; tests compare them. */
#include "tier_io.h"
#include "file_pages.h"
#include "reader.h"
#include "../csupport/grow.h"
#include "../residency/core/residency_core.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

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
    int32_t helping;                         /* the key a waiting step drops now, or -1 */
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

/* ---- the mappings ---------------------------------------------------------------------- */

int rt_set_regions(rt_tier *t, int32_t n, const int64_t *file_off, const int64_t *length,
                   const int64_t *addr, const int32_t *copy) {
    return fp_set_regions(t->file, n, file_off, length, addr, copy);
}

/* ---- drops ----------------------------------------------------------------------------- */

static int in_use(const rt_tier *t, int32_t f) { return t->held[f] || t->busy[f] || t->cur[f]; }

/* every byte of the edge page belongs to experts other than `self` that are not in use */
static int page_free(const rt_tier *t, int64_t edge, int32_t self) {
    if (!t->edge_full[edge]) return 0;
    for (int64_t i = t->edge_start[edge]; i < t->edge_start[edge + 1]; i++) {
        const int32_t o = t->edge_owner[i];
        if (o != self && in_use(t, o)) return 0;
    }
    return 1;
}

int32_t rt_droppable(const rt_tier *t, int32_t flat, int64_t *off, int64_t *len, int32_t cap) {
    int32_t n = 0;
    const int64_t p = t->page;
    for (int64_t r = t->range_start[flat]; r < t->range_start[flat + 1]; r++) {
        const int64_t o = t->range_off[r], l = t->range_len[r];
        int64_t lo = o / p, hi = (o + l - 1) / p;                /* inclusive page numbers */
        if (o % p && !page_free(t, 2 * r, flat)) lo++;
        if ((o + l) % p && hi >= lo && !page_free(t, 2 * r + 1, flat)) hi--;
        if (hi < lo) continue;
        if (n < cap) { off[n] = lo * p; len[n] = (hi - lo + 1) * p; }
        n++;
    }
    return n;
}

int64_t rt_drop(rt_tier *t, int32_t flat) {
    if (flat < 0 || flat >= t->n_flat || in_use(t, flat)) return 0;
    int64_t off[16], len[16], total = 0;
    int32_t n = rt_droppable(t, flat, off, len, 16);
    if (n > 16) n = 16;
    for (int32_t i = 0; i < n; i++) {
        fp_drop(t->file, off[i], len[i], t->mlock);
        total += len[i];
    }
    return total;
}

/* ---- reads ----------------------------------------------------------------------------- */

int rt_page_in(rt_tier *t, const int64_t *off, const int64_t *len, int32_t n) {
    if (n <= 0) return 0;
    t->stats.reads += n;
    if (rd_read_now(t->reader, off, len, n) == 0) return 0;
    snprintf(t->msg, sizeof t->msg, "ram tier: %s", rd_error(t->reader));
    return -1;
}

static void cancel_drop(rt_tier *t, int32_t f);

/* queue key f's ranges at `prio` (RD_DEMAND / RD_PREFETCH) */
static void queue_key(rt_tier *t, int32_t f, int32_t prio) {
    int32_t ids[16];
    int32_t n = 0;
    cancel_drop(t, f);                      /* its pages stay: a queued drop of it is void */
    for (int64_t r = t->range_start[f]; r < t->range_start[f + 1]; r++) {
        ids[n++] = (int32_t) r;
        if (n == 16) { rd_queue_many(t->reader, ids, n, prio); n = 0; }
    }
    if (n) rd_queue_many(t->reader, ids, n, prio);
    t->stats.reads += t->range_start[f + 1] - t->range_start[f];
}

/* no read of key f's ranges queued or running any more (before its pages may leave) */
static void cancel_key(rt_tier *t, int32_t f) {
    for (int64_t r = t->range_start[f]; r < t->range_start[f + 1]; r++)
        rd_cancel(t->reader, (int32_t) r);
}

static void read_failed(rt_tier *t) {
    const char *why = rd_error(t->reader);
    snprintf(t->msg, sizeof t->msg, "ram tier: %s", why ? why : "a read failed");
    t->failed = 1;
}

/* ---- events ---------------------------------------------------------------------------- */

static void event(rt_tier *t, int32_t kind, int32_t flat) {
    int64_t cap_k = t->cap_ev, cap_f = t->cap_ev;
    if (array_grow((void **) &t->ev_kind, &cap_k, t->n_ev + 1, sizeof *t->ev_kind) ||
        array_grow((void **) &t->ev_flat, &cap_f, t->n_ev + 1, sizeof *t->ev_flat))
        return;                   /* out of memory: the event is lost, the step goes on */
    t->cap_ev = cap_k < cap_f ? cap_k : cap_f;
    t->ev_kind[t->n_ev] = kind;
    t->ev_flat[t->n_ev++] = flat;
}

int32_t rt_n_events(const rt_tier *t) { return t->n_ev; }

int rt_events(const rt_tier *t, int32_t *kind, int32_t *flat) {
    if (t->n_ev) {
        memcpy(kind, t->ev_kind, (size_t) t->n_ev * sizeof *kind);
        memcpy(flat, t->ev_flat, (size_t) t->n_ev * sizeof *flat);
    }
    return 0;
}

void rt_clear_events(rt_tier *t) { t->n_ev = 0; t->reclaimed_layer = -1; }
int32_t rt_reclaimed_layer(const rt_tier *t) { return t->reclaimed_layer; }

/* ---- the layer-step -------------------------------------------------------------------- */

/* ---- drops, off the decode thread -------------------------------------------------------- */

static int64_t key_bytes(const rt_tier *t, int32_t f) {
    int64_t n = 0;
    for (int64_t r = t->range_start[f]; r < t->range_start[f + 1]; r++) n += t->range_len[r];
    return n;
}

/* key f's pages are to leave (rt_drop, which spares pages a held, busy or running expert
 * shares, decides when the drop runs) */
static void drop_later(rt_tier *t, int32_t f) {
    if (!t->drop_started) {               /* no drop thread: at once */
        rt_drop(t, f);
        return;
    }
    pthread_mutex_lock(&t->drop_mu);
    if (!t->drop_pending[f]) {
        t->drop_pending[f] = 1;
        t->drop_ring[(t->drop_head + t->drop_n) % t->n_flat] = f;
        t->drop_n++;
        t->drop_bytes += key_bytes(t, f);
        pthread_cond_signal(&t->drop_cv);
    }
    pthread_mutex_unlock(&t->drop_mu);
}

/* key f is read or used again: a drop of it still queued is void, one running is waited for */
static void cancel_drop(rt_tier *t, int32_t f) {
    if (!t->drop_started) return;
    pthread_mutex_lock(&t->drop_mu);
    if (t->drop_pending[f]) {
        t->drop_pending[f] = 0;             /* its ring entry is skipped */
        t->drop_bytes -= key_bytes(t, f);
    }
    while (t->dropping == f || t->helping == f) pthread_cond_wait(&t->drop_idle, &t->drop_mu);
    pthread_mutex_unlock(&t->drop_mu);
}

/* run the next queued drop on this thread, `*running` naming its key meanwhile (drop_mu held
 * on entry and on return); 0 when none is queued */
static int drop_next_locked(rt_tier *t, int32_t *running) {
    while (t->drop_n > 0) {
        const int32_t f = t->drop_ring[t->drop_head];
        t->drop_head = (t->drop_head + 1) % t->n_flat;
        t->drop_n--;
        if (!t->drop_pending[f]) continue;  /* cancelled */
        t->drop_pending[f] = 0;
        *running = f;
        pthread_mutex_unlock(&t->drop_mu);
        rt_drop(t, f);
        pthread_mutex_lock(&t->drop_mu);
        t->drop_bytes -= key_bytes(t, f);
        *running = -1;
        pthread_cond_broadcast(&t->drop_idle);
        return 1;
    }
    return 0;
}

static void *drop_main(void *arg) {
    rt_tier *t = arg;
    rd_batch_thread();
    pthread_mutex_lock(&t->drop_mu);
    for (;;) {
        while (!t->drop_stop && t->drop_n == 0) pthread_cond_wait(&t->drop_cv, &t->drop_mu);
        if (t->drop_n == 0) break;          /* stopping, nothing left */
        drop_next_locked(t, &t->dropping);
    }
    pthread_mutex_unlock(&t->drop_mu);
    return NULL;
}

int64_t rt_pending_drop_bytes(rt_tier *t) {
    if (!t->drop_started) return 0;
    pthread_mutex_lock(&t->drop_mu);
    const int64_t n = t->drop_bytes + (t->dropping >= 0 ? key_bytes(t, t->dropping) : 0) +
                      (t->helping >= 0 ? key_bytes(t, t->helping) : 0);
    pthread_mutex_unlock(&t->drop_mu);
    return n;
}

void rt_drain_drops(rt_tier *t) {
    if (!t->drop_started) return;
    pthread_mutex_lock(&t->drop_mu);
    while (t->drop_n > 0 || t->dropping >= 0 || t->helping >= 0) {
        pthread_mutex_unlock(&t->drop_mu);
        struct timespec ts = {0, 200000};
        nanosleep(&ts, NULL);
        pthread_mutex_lock(&t->drop_mu);
    }
    pthread_mutex_unlock(&t->drop_mu);
}

/* a prefetch the core issued: its reads go behind the demand reads once the step has room
 * (rt_step queues them) and the step goes on; its first use waits for what is still coming.
 * Held at once: its edge pages are protected while they come in. */
static void prefetch(rt_tier *t, int32_t f) {
    t->pf_list[t->n_pf++] = f;
    for (int64_t r = t->range_start[f]; r < t->range_start[f + 1]; r++)
        t->stats.prefetched_bytes += t->range_len[r];
    t->advised[f] = 1;
    t->held[f] = 1;
}

/* Before a layer-step reads anything: the pages the core does not count (the queued drops:
 * keys evicted, by this step too, and the previous layer-step's transient uses; plus this
 * step's transient uses, `one_use` bytes, about to be read) must fit the one-use room, or
 * the page cache would pass the budget (the core fills its capacity, the room is the rest).
 * Until they do, the step runs queued drops itself (the drop thread may not get a core on a
 * busy machine), then waits for the one the drop thread runs; a drained queue holds nothing,
 * and one step's transient uses are one layer's experts at most, which the room holds. Costs
 * nothing while the queue is short (decode: a few experts a step); a prompt's layer-step
 * that evicts or passes over a whole layer may drop about the previous one's keys. */
static int64_t now_ns(void);

static void wait_for_room(rt_tier *t, int64_t one_use) {
    if (!t->drop_started) {                 /* drops run at once: nothing queued */
        if (one_use > t->stats.one_use_peak) t->stats.one_use_peak = one_use;
        return;
    }
    int64_t t0 = 0;
    pthread_mutex_lock(&t->drop_mu);
    /* drop_bytes counts a key until its drop has run (the one running included) */
    while (t->one_use_room >= 0 && t->drop_bytes + one_use > t->one_use_room &&
           (t->drop_n > 0 || t->dropping >= 0)) {
        if (t0 == 0) t0 = now_ns();
        if (!drop_next_locked(t, &t->helping)) pthread_cond_wait(&t->drop_idle, &t->drop_mu);
    }
    const int64_t used = t->drop_bytes + one_use;
    pthread_mutex_unlock(&t->drop_mu);
    if (used > t->stats.one_use_peak) t->stats.one_use_peak = used;
    if (t0) t->stats.drop_wait_ns += now_ns() - t0;
}

static void evict(rt_tier *t, int32_t f) {
    t->advised[f] = 0;
    t->held[f] = 0;               /* a busy key: its read's completion drops the pages */
    t->stats.dropped++;
    cancel_key(t, f);
    drop_later(t, f);
    event(t, RT_EV_DROP, f);
}

static void finish_layer(rt_tier *t) {
    for (int32_t i = 0; i < t->n_cur; i++) t->cur[t->cur_list[i]] = 0;
    t->n_cur = 0;
    for (int32_t i = 0; i < t->n_transient; i++) {
        cancel_key(t, t->transient[i]);      /* read by now (the matmul waited for it) */
        drop_later(t, t->transient[i]);
    }
    t->n_transient = 0;
}

/* the layer-step's ranges to read: range ids (want_off holds them) */
static int want(rt_tier *t, int64_t r) {
    int64_t cap = t->cap_want, cap_l = t->cap_want;
    if (array_grow((void **) &t->want_off, &cap, t->n_want + 1, sizeof *t->want_off) ||
        array_grow((void **) &t->want_len, &cap_l, t->n_want + 1, sizeof *t->want_len))
        return -1;
    t->cap_want = cap < cap_l ? cap : cap_l;
    t->want_off[t->n_want++] = r;
    return 0;
}

static int want_all(rt_tier *t, int32_t f) {
    for (int64_t r = t->range_start[f]; r < t->range_start[f + 1]; r++)
        if (want(t, r) != 0) return -1;
    return 0;
}

static int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t) ts.tv_sec * 1000000000 + ts.tv_nsec;
}

int rt_step(rt_tier *t, int32_t layer, const int32_t *experts, int32_t n, int32_t phase) {
    const int64_t t0 = now_ns();
    finish_layer(t);              /* the previous layer's matmul has run: the graph is serial */
    if (t->failed) {              /* a read the previous layer's matmul waited for failed */
        read_failed(t);
        return -1;
    }
    rc_result r;
    const int rc = rc_step(t->core, &t->lease, layer, experts, n, phase, &r);
    if (rc != 0) {
        rc_step_message(t->msg, sizeof t->msg, "ram tier: ", layer, rc);
        return -1;
    }
    t->stats.routes++;
    for (int32_t i = 0; i < n; i++) {
        const int32_t f = layer * t->n_expert + experts[i];
        if (!t->cur[f]) {
            t->cur[f] = 1;                  /* in use: no drop touches its pages now */
            t->cur_list[t->n_cur++] = f;
            cancel_drop(t, f);
        }
    }
    for (int32_t i = 0; i < r.n_evicted; i++) evict(t, r.evicted[i]);
    t->n_pf = 0;
    for (int32_t i = 0, v = 0; i < r.n_prefetched; i++) {
        for (int32_t j = 0; j < r.prefetch_n_victims[i]; j++) evict(t, r.prefetch_victims[v++]);
        prefetch(t, r.prefetched[i]);
    }
    for (int32_t i = 0; i < r.n_admitted; i++) t->mark[r.admitted[i]] = 1;
    int64_t one_use = 0;
    for (int32_t i = 0; i < r.n_transient; i++) {
        t->mark[r.transient[i]] = 2;
        t->transient[t->n_transient++] = r.transient[i];
        one_use += key_bytes(t, r.transient[i]);
    }
    wait_for_room(t, one_use);    /* before any read: the budget holds throughout */
    /* what to read, in the order the matmul takes the experts (first use): admissions and
     * transient uses whole; a busy key (a background read of Python's) and a prefetched one
     * (its reads may still be queued) whole: what is in already is read from the page cache
     * (no disk); hits only where the kernel took pages back (a one-page mincore probe per
     * layer-step, then mincore per range) */
    t->n_want = 0;
    int probe_failed = 0, oom = 0;
    for (int32_t i = 0; i < t->n_cur; i++) {
        const int32_t f = t->cur_list[i];
        if (t->mark[f] || t->busy[f] || t->advised[f]) oom |= want_all(t, f);
        else if (!probe_failed) {
            const int64_t first = t->range_off[t->range_start[f]];
            probe_failed = !fp_resident(t->file, first, 1);
        }
    }
    int64_t reclaimed = 0;
    if (probe_failed)
        for (int32_t i = 0; i < t->n_cur; i++) {
            const int32_t f = t->cur_list[i];
            if (t->mark[f] || t->busy[f] || t->advised[f]) continue;
            for (int64_t q = t->range_start[f]; q < t->range_start[f + 1]; q++)
                if (!fp_resident(t->file, t->range_off[q], t->range_len[q])) {
                    oom |= want(t, q);
                    reclaimed += t->range_len[q];
                }
        }
    if (oom) {
        snprintf(t->msg, sizeof t->msg, "ram tier: out of memory");
        return -1;
    }
    if (reclaimed && t->reclaimed_layer < 0) {
        t->reclaimed_layer = layer;
        if (t->on_reclaim) t->on_reclaim(layer, t->on_reclaim_user);
    }
    int64_t bytes = 0;
    int32_t *ids = (int32_t *) t->want_len;  /* (n_want,) range ids, for one queueing */
    for (int32_t i = 0; i < t->n_want; i++) {
        ids[i] = (int32_t) t->want_off[i];
        bytes += t->range_len[ids[i]];
    }
    rd_queue_many(t->reader, ids, t->n_want, RD_DEMAND);
    t->stats.reads += t->n_want;
    for (int32_t i = 0; i < t->n_pf; i++) queue_key(t, t->pf_list[i], RD_PREFETCH);
    int failed = 0;
    if (!t->async)                /* no matmul hook: every byte in before the matmul runs */
        for (int32_t i = 0; i < t->n_want; i++) {
            const int32_t q = (int32_t) t->want_off[i];
            rd_use(t->reader, q);
            if (rd_wait(t->reader, q) != 0) failed = 1;
        }
    if (failed) read_failed(t);
    for (int32_t i = 0; i < t->n_cur; i++) {
        const int32_t f = t->cur_list[i];
        if (!failed && t->mark[f] != 2 && rc_state(t->core, f) < 8) {
            if (t->mark[f] == 1) event(t, RT_EV_ADMIT, f);
            t->held[f] = 1;
        }
        t->mark[f] = 0;
        t->advised[f] = 0;
    }
    t->stats.paged_bytes += bytes;
    t->stats.reclaimed_bytes += reclaimed;
    t->stats.step_ns += now_ns() - t0;
    return failed ? -1 : 0;
}

/* ---- the matmul's hook (ggml_cpu_set_weight_ready: llamacpp/patches/0007) ----------------- */

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

int rt_batch_end(rt_tier *t) {
    finish_layer(t);
    rc_step_end(t->core, &t->lease);
    const int failed = t->failed;
    if (failed) read_failed(t);   /* t->msg says which read */
    t->failed = 0;                /* the next batch starts clean (a bad file fails it again) */
    rd_clear_error(t->reader);
    return failed ? -1 : 0;
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

static const rt_tier *g_sort_tier;       /* qsort's context (rt_create, under no lock) */
static int by_offset(const void *a, const void *b) {
    const int64_t x = g_sort_tier->range_off[*(const int32_t *) a];
    const int64_t y = g_sort_tier->range_off[*(const int32_t *) b];
    return x < y ? -1 : x > y;
}

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
    for (int32_t r = 0; r < t->n_ranges; r++) t->by_off[r] = r;
    pthread_rwlock_wrlock(&g_tiers_lock);    /* qsort has no context argument */
    g_sort_tier = t;
    qsort(t->by_off, (size_t) t->n_ranges, sizeof *t->by_off, by_offset);
    g_sort_tier = NULL;
    pthread_rwlock_unlock(&g_tiers_lock);
    t->page = fp_page_size(t->file);
    t->dropping = -1;
    t->helping = -1;
    t->drop_ring = malloc((size_t) t->n_flat * sizeof *t->drop_ring);
    t->drop_pending = calloc((size_t) t->n_flat, 1);
    if (t->drop_ring && t->drop_pending) {
        pthread_mutex_init(&t->drop_mu, NULL);
        pthread_cond_init(&t->drop_cv, NULL);
        pthread_cond_init(&t->drop_idle, NULL);
        t->drop_started = pthread_create(&t->drop_thread, NULL, drop_main, t) == 0;
        if (!t->drop_started) {
            pthread_mutex_destroy(&t->drop_mu);
            pthread_cond_destroy(&t->drop_cv);
            pthread_cond_destroy(&t->drop_idle);
        }
    }
    return t;
}

void rt_free(rt_tier *t) {
    if (t == NULL) return;
    rt_set_async(t, 0);                      /* no matmul looks this tier up any more */
    if (t->drop_started) {                   /* the queued drops run, then the thread ends */
        pthread_mutex_lock(&t->drop_mu);
        t->drop_stop = 1;
        pthread_cond_signal(&t->drop_cv);
        pthread_mutex_unlock(&t->drop_mu);
        pthread_join(t->drop_thread, NULL);
        pthread_mutex_destroy(&t->drop_mu);
        pthread_cond_destroy(&t->drop_cv);
        pthread_cond_destroy(&t->drop_idle);
    }
    free(t->drop_ring); free(t->drop_pending);
    rd_free(t->reader);
    fp_free(t->file);
    free(t->cur); free(t->mark); free(t->advised); free(t->cur_list); free(t->transient);
    free(t->pf_list);
    free(t->by_off);
    free(t->want_off); free(t->want_len); free(t->ev_kind); free(t->ev_flat);
    free(t);
}
