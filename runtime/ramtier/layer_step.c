/* layer_step: the RAM tier's layer-step (rt_step) and batch end (rt_batch_end): the core's
 * decisions, the reads they need (queued on the reader, demand before prefetch), the drops of
 * what left, and the events Python drains once per batch. The Python reference of the reads
 * is Pager.page_in (pager.py); tests compare them. */
#include "tier_io_impl.h"
#include "../csupport/grow.h"

#include <stdio.h>
#include <string.h>
#include <time.h>

/* ---- reads ----------------------------------------------------------------------------- */

int rt_page_in(rt_tier *t, const int64_t *off, const int64_t *len, int32_t n) {
    if (n <= 0) return 0;
    t->stats.reads += n;
    if (rd_read_now(t->reader, off, len, n) == 0) return 0;
    snprintf(t->msg, sizeof t->msg, "ram tier: %s", rd_error(t->reader));
    return -1;
}

/* queue key f's ranges at `prio` (RD_DEMAND / RD_PREFETCH) */
static void queue_key(rt_tier *t, int32_t f, int32_t prio) {
    int32_t ids[16];
    int32_t n = 0;
    rt_cancel_drop(t, f);                   /* its pages stay: a queued drop of it is void */
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

/* a prefetch the core issued: its reads go behind the demand reads once the step has room
 * (rt_step queues them: rt_make_room) and the step goes on; its first use waits for what is
 * still coming. Held at once: its edge pages are protected while they come in. */
static void prefetch(rt_tier *t, int32_t f) {
    t->pf_list[t->n_pf++] = f;
    for (int64_t r = t->range_start[f]; r < t->range_start[f + 1]; r++)
        t->stats.prefetched_bytes += t->range_len[r];
    t->advised[f] = 1;
    t->held[f] = 1;
}

static void evict(rt_tier *t, int32_t f) {
    t->advised[f] = 0;
    t->held[f] = 0;               /* a busy key: its read's completion drops the pages */
    t->stats.dropped++;
    cancel_key(t, f);
    rt_drop_later(t, f);
    event(t, RT_EV_DROP, f);
}

static void finish_layer(rt_tier *t) {
    for (int32_t i = 0; i < t->n_cur; i++) t->cur[t->cur_list[i]] = 0;
    t->n_cur = 0;
    for (int32_t i = 0; i < t->n_transient; i++) {
        cancel_key(t, t->transient[i]);      /* read by now (the matmul waited for it) */
        rt_drop_later(t, t->transient[i]);
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
            rt_cancel_drop(t, f);
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
        one_use += rt_key_bytes(t, r.transient[i]);
    }
    rt_make_room(t, one_use);     /* before any read: the budget holds throughout */
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


int rt_batch_end(rt_tier *t) {
    finish_layer(t);
    rc_step_end(t->core, &t->lease);
    const int failed = t->failed;
    if (failed) read_failed(t);   /* t->msg says which read */
    t->failed = 0;                /* the next batch starts clean (a bad file fails it again) */
    rd_clear_error(t->reader);
    return failed ? -1 : 0;
}

