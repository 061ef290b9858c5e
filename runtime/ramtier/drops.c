/* drops: which of a key's pages may leave (none a held, busy or running expert shares) and
 * the tier's drop thread, which makes them leave off the decode thread. The Python reference
 * of the rule is ExpertLayout.droppable (runtime/ramtier/layout.py); tests compare them. */
#include "tier_io_impl.h"

#include <stdlib.h>
#include <time.h>

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

/* ---- drops, off the decode thread -------------------------------------------------------- */

int64_t rt_key_bytes(const rt_tier *t, int32_t f) {
    int64_t n = 0;
    for (int64_t r = t->range_start[f]; r < t->range_start[f + 1]; r++) n += t->range_len[r];
    return n;
}

/* key f's pages are to leave (rt_drop, which spares pages a held, busy or running expert
 * shares, decides when the drop runs) */
void rt_drop_later(rt_tier *t, int32_t f) {
    if (!t->drop_started) {               /* no drop thread: at once */
        rt_drop(t, f);
        return;
    }
    pthread_mutex_lock(&t->drop_mu);
    if (!t->drop_pending[f]) {
        t->drop_pending[f] = 1;
        t->drop_ring[(t->drop_head + t->drop_n) % t->n_flat] = f;
        t->drop_n++;
        t->drop_bytes += rt_key_bytes(t, f);
        pthread_cond_signal(&t->drop_cv);
    }
    pthread_mutex_unlock(&t->drop_mu);
}

/* key f is read or used again: a drop of it still queued is void, one running is waited for */
void rt_cancel_drop(rt_tier *t, int32_t f) {
    if (!t->drop_started) return;
    pthread_mutex_lock(&t->drop_mu);
    if (t->drop_pending[f]) {
        t->drop_pending[f] = 0;             /* its ring entry is skipped */
        t->drop_bytes -= rt_key_bytes(t, f);
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
        t->drop_bytes -= rt_key_bytes(t, f);
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

static int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t) ts.tv_sec * 1000000000 + ts.tv_nsec;
}

/* Before a layer-step reads anything: the pages the core does not count (the queued drops:
 * keys evicted, by this step too, and the previous layer-step's transient uses; plus this
 * step's transient uses, `one_use` bytes, about to be read) must fit the one-use room, or
 * the page cache would pass the budget (the core fills its capacity, the room is the rest).
 * Until they do, the step runs queued drops itself (the drop thread may get no core on a
 * busy machine), then waits for the one the drop thread runs; a drained queue holds nothing,
 * and one step's transient uses are one layer's experts at most, which the room holds. Costs
 * nothing while the queue is short (decode: a few experts a step); a prompt's layer-step
 * that evicts or passes over a whole layer may drop about the previous one's keys. */
void rt_make_room(rt_tier *t, int64_t one_use) {
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

int64_t rt_pending_drop_bytes(rt_tier *t) {
    if (!t->drop_started) return 0;
    pthread_mutex_lock(&t->drop_mu);
    const int64_t n = t->drop_bytes + (t->dropping >= 0 ? rt_key_bytes(t, t->dropping) : 0) +
                      (t->helping >= 0 ? rt_key_bytes(t, t->helping) : 0);
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

void rt_drops_start(rt_tier *t) {
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
}

void rt_drops_stop(rt_tier *t) {
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
}
