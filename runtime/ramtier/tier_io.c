/* tier_io: see tier_io.h. The Python references of the same rules: ExpertLayout.droppable
 * (runtime/ramtier/layout.py) for which pages may leave, Pager.page_in (pager.py) for the
 * reads; tests compare them. */
#define _GNU_SOURCE
#include "tier_io.h"
#include "../residency/core/residency_core.h"

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#define CHUNK_BYTES (1 << 20)                   /* one pread / wait unit */
#define TIER_LEASE_BASE (((int64_t) 1) << 52)   /* apart from the manager's and hook's ids */

typedef struct { int64_t off, len; int32_t advised; } chunk;
typedef struct { int64_t off, len, addr; int32_t copy; } region;

struct rt_tier {
    rc_core *core;
    int32_t n_layer, n_expert, n_flat, threads, mlock;
    int fd;
    long page;
    const int64_t *range_start, *range_off, *range_len, *edge_start;
    const int32_t *edge_owner;
    const uint8_t *edge_full;
    uint8_t *held, *busy;
    uint8_t *cur;                  /* (n_flat,) in use by the running layer-step */
    uint8_t *mark;                 /* (n_flat,) scratch: 1 admitted, 2 transient */
    int32_t *cur_list, n_cur;      /* the running layer-step's keys */
    int32_t *transient, n_transient;
    int64_t lease, next_lease;
    region *regions; int32_t n_regions;
    /* reads of one rt_page_in */
    chunk *chunks; int64_t n_chunks, cap_chunks, next_chunk, completed;
    int64_t *want_off, *want_len; int32_t n_want;
    int64_t cap_want;
    pthread_t *workers; int32_t n_workers;
    pthread_mutex_t mu;
    pthread_cond_t go, done;
    int64_t gen;
    int32_t active, stop, io_error;
    char io_msg[200];
    /* events and counters */
    int32_t *ev_kind, *ev_flat, n_ev;
    int64_t cap_ev;
    int32_t reclaimed_layer;
    rt_stats stats;
    char msg[256];
};

/* make room for `need` items of `item` bytes in *p (capacity *cap, doubled); 0 or -1 */
static int grow(void **p, int64_t *cap, int64_t need, size_t item) {
    if (need <= *cap) return 0;
    int64_t c = *cap ? *cap : 64;
    while (c < need) c *= 2;
    void *q = realloc(*p, (size_t) c * item);
    if (q == NULL) return -1;
    *p = q;
    *cap = c;
    return 0;
}

/* ---- the mappings ---------------------------------------------------------------------- */

int rt_set_regions(rt_tier *t, int32_t n, const int64_t *file_off, const int64_t *length,
                   const int64_t *addr, const int32_t *copy) {
    region *r = n ? malloc((size_t) n * sizeof *r) : NULL;
    if (n && r == NULL) return -1;
    for (int32_t i = 0; i < n; i++) {
        r[i].off = file_off[i]; r[i].len = length[i]; r[i].addr = addr[i]; r[i].copy = copy[i];
    }
    free(t->regions);
    t->regions = r;
    t->n_regions = n;
    return 0;
}

/* the address of file bytes [off, off + len) in copy 0, or 0 when one region does not map all */
static char *addr_of(const rt_tier *t, int64_t off, int64_t len) {
    for (int32_t i = 0; i < t->n_regions; i++) {
        const region *r = &t->regions[i];
        if (r->copy == 0 && r->off <= off && off + len <= r->off + r->len)
            return (char *) (intptr_t) (r->addr + (off - r->off));
    }
    return NULL;
}

/* every page of file bytes [off, off + len) is in the page cache (mincore on copy 0) */
static int resident(const rt_tier *t, int64_t off, int64_t len) {
    char *addr = addr_of(t, off, len);
    if (addr == NULL) return 0;
    const uintptr_t lo = (uintptr_t) addr & ~(uintptr_t) (t->page - 1);
    const uintptr_t hi = (uintptr_t) addr + (uintptr_t) len;
    unsigned char vec[256];
    for (uintptr_t at = lo; at < hi;) {
        size_t n_pages = (hi - at + (uintptr_t) t->page - 1) / (uintptr_t) t->page;
        if (n_pages > sizeof vec) n_pages = sizeof vec;
        if (mincore((void *) at, n_pages * (size_t) t->page, vec) != 0) return 0;
        for (size_t i = 0; i < n_pages; i++)
            if (!(vec[i] & 1)) return 0;
        at += n_pages * (uintptr_t) t->page;
    }
    return 1;
}

/* ---- reads ----------------------------------------------------------------------------- */

static void io_fail(rt_tier *t, const char *what, int64_t off, int err) {
    pthread_mutex_lock(&t->mu);
    if (!t->io_error) {
        t->io_error = 1;
        if (err) snprintf(t->io_msg, sizeof t->io_msg, "%s at offset %lld: %s", what,
                          (long long) off, strerror(err));
        else snprintf(t->io_msg, sizeof t->io_msg, "%s at offset %lld (the model file was "
                      "truncated?)", what, (long long) off);
    }
    pthread_mutex_unlock(&t->mu);
}

static int read_whole(rt_tier *t, int64_t off, int64_t len, char *buf) {
    while (len > 0) {
        const ssize_t got = pread(t->fd, buf, (size_t) (len < CHUNK_BYTES ? len : CHUNK_BYTES),
                                  off);
        if (got < 0 && errno == EINTR) continue;
        if (got <= 0) {
            io_fail(t, got < 0 ? "read failed" : "short read", off, got < 0 ? errno : 0);
            return -1;
        }
        off += got;
        len -= got;
    }
    return 0;
}

/* an advised chunk: the one-byte pread of its last byte waits for the kernel's read of that
 * page; the kernel may finish the others out of order, so mincore confirms, and a chunk still
 * short (in flight, or skipped) is read whole, which waits for every page */
static int read_chunk(rt_tier *t, const chunk *c, char *buf) {
    if (c->advised) {
        ssize_t got;
        do got = pread(t->fd, buf, 1, c->off + c->len - 1); while (got < 0 && errno == EINTR);
        if (got <= 0) {
            io_fail(t, got < 0 ? "read failed" : "short read", c->off + c->len - 1,
                    got < 0 ? errno : 0);
            return -1;
        }
        if (resident(t, c->off, c->len)) return 0;
    }
    return read_whole(t, c->off, c->len, buf);
}

static void run_chunks(rt_tier *t, char *buf) {
    for (;;) {
        const int64_t i = __atomic_fetch_add(&t->next_chunk, 1, __ATOMIC_ACQ_REL);
        if (i >= t->n_chunks) return;
        read_chunk(t, &t->chunks[i], buf);
        pthread_mutex_lock(&t->mu);
        if (++t->completed == t->n_chunks) pthread_cond_broadcast(&t->done);
        pthread_mutex_unlock(&t->mu);
    }
}

static void *worker(void *arg) {
    rt_tier *t = arg;
    char *buf = malloc(CHUNK_BYTES);
    int64_t seen = 0;
    pthread_mutex_lock(&t->mu);
    for (;;) {
        while (!t->stop && t->gen == seen) pthread_cond_wait(&t->go, &t->mu);
        if (t->stop || buf == NULL) break;
        seen = t->gen;
        t->active++;
        pthread_mutex_unlock(&t->mu);
        run_chunks(t, buf);
        pthread_mutex_lock(&t->mu);
        if (--t->active == 0) pthread_cond_broadcast(&t->done);
    }
    pthread_mutex_unlock(&t->mu);
    free(buf);
    return NULL;
}

static int push_chunk(rt_tier *t, int64_t off, int64_t len, int32_t advised) {
    if (grow((void **) &t->chunks, &t->cap_chunks, t->n_chunks + 1, sizeof *t->chunks)) return -1;
    t->chunks[t->n_chunks++] = (chunk) {off, len, advised};
    return 0;
}

int rt_page_in(rt_tier *t, const int64_t *off, const int64_t *len, int32_t n) {
    static __thread char *own_buf;
    if (n <= 0) return 0;
    if (own_buf == NULL && (own_buf = malloc(CHUNK_BYTES)) == NULL) goto nomem;
    pthread_mutex_lock(&t->mu);
    while (t->active > 0) pthread_cond_wait(&t->done, &t->mu);   /* stragglers of the last */
    /* a worker still waking for the last call takes no chunk while the list is rebuilt */
    __atomic_store_n(&t->next_chunk, INT64_MAX / 2, __ATOMIC_RELEASE);
    t->n_chunks = 0;
    pthread_mutex_unlock(&t->mu);
    for (int32_t i = 0; i < n; i++) {
        /* WILLNEED queues the range's reads at once (no copy on our side) */
        char *addr = addr_of(t, off[i], len[i]);
        int32_t advised = 0;
        if (addr != NULL) {
            const uintptr_t lo = (uintptr_t) addr & ~(uintptr_t) (t->page - 1);
            advised = madvise((void *) lo, (size_t) ((uintptr_t) addr + (uintptr_t) len[i] - lo),
                              MADV_WILLNEED) == 0;
        }
        for (int64_t at = 0; at < len[i]; at += CHUNK_BYTES)
            if (push_chunk(t, off[i] + at, len[i] - at < CHUNK_BYTES ? len[i] - at : CHUNK_BYTES,
                           advised) != 0) goto nomem;
    }
    pthread_mutex_lock(&t->mu);
    t->io_error = 0;
    t->completed = 0;
    __atomic_store_n(&t->next_chunk, 0, __ATOMIC_RELEASE);
    t->gen++;
    pthread_cond_broadcast(&t->go);
    pthread_mutex_unlock(&t->mu);
    run_chunks(t, own_buf);                        /* this thread reads too */
    pthread_mutex_lock(&t->mu);
    while (t->completed < t->n_chunks) pthread_cond_wait(&t->done, &t->mu);
    const int failed = t->io_error;
    if (failed) snprintf(t->msg, sizeof t->msg, "ram tier: %s", t->io_msg);
    pthread_mutex_unlock(&t->mu);
    t->stats.reads += n;
    return failed ? -1 : 0;
nomem:
    snprintf(t->msg, sizeof t->msg, "ram tier: out of memory");
    return -1;
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
        for (int32_t j = 0; j < t->n_regions; j++) {      /* a mapped page cannot leave */
            const region *r = &t->regions[j];
            const int64_t lo = off[i] > r->off ? off[i] : r->off;
            const int64_t hi = off[i] + len[i] < r->off + r->len ? off[i] + len[i]
                                                                 : r->off + r->len;
            if (lo >= hi) continue;
            void *a = (void *) (intptr_t) (r->addr + (lo - r->off));
            if (t->mlock) munlock(a, (size_t) (hi - lo));
            madvise(a, (size_t) (hi - lo), MADV_DONTNEED);
        }
        posix_fadvise(t->fd, off[i], len[i], POSIX_FADV_DONTNEED);
        total += len[i];
    }
    return total;
}

/* ---- events ---------------------------------------------------------------------------- */

static void event(rt_tier *t, int32_t kind, int32_t flat) {
    int64_t cap_k = t->cap_ev, cap_f = t->cap_ev;
    if (grow((void **) &t->ev_kind, &cap_k, t->n_ev + 1, sizeof *t->ev_kind) ||
        grow((void **) &t->ev_flat, &cap_f, t->n_ev + 1, sizeof *t->ev_flat))
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

static void evict(rt_tier *t, int32_t f) {
    t->held[f] = 0;               /* a busy key: its read's completion drops the pages */
    t->stats.dropped++;
    rt_drop(t, f);
    event(t, RT_EV_DROP, f);
}

static void finish_layer(rt_tier *t) {
    for (int32_t i = 0; i < t->n_cur; i++) t->cur[t->cur_list[i]] = 0;
    t->n_cur = 0;
    for (int32_t i = 0; i < t->n_transient; i++) rt_drop(t, t->transient[i]);
    t->n_transient = 0;
}

static int want(rt_tier *t, int64_t off, int64_t len) {
    int64_t cap_o = t->cap_want, cap_l = t->cap_want;
    if (grow((void **) &t->want_off, &cap_o, t->n_want + 1, sizeof *t->want_off) ||
        grow((void **) &t->want_len, &cap_l, t->n_want + 1, sizeof *t->want_len))
        return -1;
    t->cap_want = cap_o < cap_l ? cap_o : cap_l;
    t->want_off[t->n_want] = off;
    t->want_len[t->n_want++] = len;
    return 0;
}

static int want_all(rt_tier *t, int32_t f) {
    for (int64_t r = t->range_start[f]; r < t->range_start[f + 1]; r++)
        if (want(t, t->range_off[r], t->range_len[r]) != 0) return -1;
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
    const int64_t lease = t->next_lease++;
    rc_result r;
    const int rc = rc_access(t->core, layer, experts, n, phase, NULL, -1, NULL, NULL, 0, lease,
                             t->lease, &r);
    t->lease = rc == 0 ? lease : 0;
    if (rc != 0) {
        snprintf(t->msg, sizeof t->msg, "ram tier: the residency core refused layer %d "
                 "(status %d)", layer, rc);
        return -1;
    }
    t->stats.routes++;
    for (int32_t i = 0; i < n; i++) {
        const int32_t f = layer * t->n_expert + experts[i];
        if (!t->cur[f]) { t->cur[f] = 1; t->cur_list[t->n_cur++] = f; }
    }
    for (int32_t i = 0; i < r.n_evicted; i++) evict(t, r.evicted[i]);
    for (int32_t i = 0, v = 0; i < r.n_prefetched; i++) {
        for (int32_t j = 0; j < r.prefetch_n_victims[i]; j++) evict(t, r.prefetch_victims[v++]);
        event(t, RT_EV_PREFETCH, r.prefetched[i]);
    }
    for (int32_t i = 0; i < r.n_admitted; i++) t->mark[r.admitted[i]] = 1;
    for (int32_t i = 0; i < r.n_transient; i++) {
        t->mark[r.transient[i]] = 2;
        t->transient[t->n_transient++] = r.transient[i];
    }
    /* what to read: admissions and transient uses whole; a busy key (its background read may
     * sit far back in the queue) whole; hits only where the kernel took pages back */
    t->n_want = 0;
    int probe_failed = 0, oom = 0;
    for (int32_t i = 0; i < t->n_cur; i++) {
        const int32_t f = t->cur_list[i];
        if (t->mark[f] || t->busy[f]) oom |= want_all(t, f);
        else if (!probe_failed) {
            const int64_t first = t->range_off[t->range_start[f]];
            probe_failed = !resident(t, first, 1);
        }
    }
    int64_t reclaimed = 0;
    if (probe_failed)
        for (int32_t i = 0; i < t->n_cur; i++) {
            const int32_t f = t->cur_list[i];
            if (t->mark[f] || t->busy[f]) continue;
            for (int64_t q = t->range_start[f]; q < t->range_start[f + 1]; q++)
                if (!resident(t, t->range_off[q], t->range_len[q])) {
                    oom |= want(t, t->range_off[q], t->range_len[q]);
                    reclaimed += t->range_len[q];
                }
        }
    if (oom) {
        snprintf(t->msg, sizeof t->msg, "ram tier: out of memory");
        return -1;
    }
    if (reclaimed && t->reclaimed_layer < 0) t->reclaimed_layer = layer;
    int64_t bytes = 0;
    for (int32_t i = 0; i < t->n_want; i++) bytes += t->want_len[i];
    const int failed = rt_page_in(t, t->want_off, t->want_len, t->n_want);
    for (int32_t i = 0; i < t->n_cur; i++) {
        const int32_t f = t->cur_list[i];
        if (!failed && t->mark[f] != 2 && rc_state(t->core, f) < 8) {
            if (t->mark[f] == 1) event(t, RT_EV_ADMIT, f);
            t->held[f] = 1;
        }
        t->mark[f] = 0;
    }
    t->stats.paged_bytes += bytes;
    t->stats.reclaimed_bytes += reclaimed;
    t->stats.wait_ns += now_ns() - t0;
    return failed ? -1 : 0;
}

void rt_batch_end(rt_tier *t) {
    finish_layer(t);
    if (t->lease) rc_release(t->core, t->lease);
    t->lease = 0;
}

const char *rt_error(const rt_tier *t) { return t->msg; }
void rt_get_stats(const rt_tier *t, rt_stats *out) { *out = t->stats; }
void rt_set_fd(rt_tier *t, int32_t fd) { t->fd = fd; }
void rt_set_mlock(rt_tier *t, int32_t on) { t->mlock = on; }

/* ---- lifetime -------------------------------------------------------------------------- */

rt_tier *rt_create(void *core, int32_t n_layer, int32_t n_expert, const int64_t *range_start,
                   const int64_t *range_off, const int64_t *range_len, const int64_t *edge_start,
                   const int32_t *edge_owner, const uint8_t *edge_full, uint8_t *held,
                   uint8_t *busy, int32_t fd, int32_t threads) {
    if (threads < 1 || n_layer < 1 || n_expert < 1) return NULL;
    rt_tier *t = calloc(1, sizeof *t);
    if (t == NULL) return NULL;
    t->core = core; t->n_layer = n_layer; t->n_expert = n_expert;
    t->n_flat = n_layer * n_expert; t->threads = threads; t->fd = fd;
    t->page = sysconf(_SC_PAGESIZE);
    t->range_start = range_start; t->range_off = range_off; t->range_len = range_len;
    t->edge_start = edge_start; t->edge_owner = edge_owner; t->edge_full = edge_full;
    t->held = held; t->busy = busy;
    t->next_lease = TIER_LEASE_BASE;
    t->reclaimed_layer = -1;
    t->cur = calloc((size_t) t->n_flat, 1);
    t->mark = calloc((size_t) t->n_flat, 1);
    t->cur_list = malloc((size_t) t->n_flat * sizeof *t->cur_list);
    t->transient = malloc((size_t) t->n_flat * sizeof *t->transient);
    pthread_mutex_init(&t->mu, NULL);
    pthread_cond_init(&t->go, NULL);
    pthread_cond_init(&t->done, NULL);
    t->workers = calloc((size_t) threads, sizeof *t->workers);
    if (!t->cur || !t->mark || !t->cur_list || !t->transient || !t->workers) {
        rt_free(t);
        return NULL;
    }
    for (int32_t i = 0; i < threads - 1; i++) {      /* + the calling thread = threads */
        if (pthread_create(&t->workers[i], NULL, worker, t) != 0) break;
        t->n_workers++;
    }
    return t;
}

void rt_free(rt_tier *t) {
    if (t == NULL) return;
    pthread_mutex_lock(&t->mu);
    t->stop = 1;
    pthread_cond_broadcast(&t->go);
    pthread_mutex_unlock(&t->mu);
    for (int32_t i = 0; i < t->n_workers; i++) pthread_join(t->workers[i], NULL);
    pthread_mutex_destroy(&t->mu);
    pthread_cond_destroy(&t->go);
    pthread_cond_destroy(&t->done);
    free(t->workers); free(t->cur); free(t->mark); free(t->cur_list); free(t->transient);
    free(t->regions); free(t->chunks); free(t->want_off); free(t->want_len);
    free(t->ev_kind); free(t->ev_flat);
    free(t);
}
