/* file_pages: see file_pages.h. */
#define _GNU_SOURCE
#include "file_pages.h"
#include "../residency/core/grow.h"

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#define CHUNK_BYTES (1 << 20)                   /* one pread / wait unit */

typedef struct { int64_t off, len; int32_t advised; } chunk;
typedef struct { int64_t off, len, addr; int32_t copy; } region;

struct fp_file {
    int fd;
    int64_t page;
    region *regions; int32_t n_regions;
    /* the reads of one fp_read */
    chunk *chunks; int64_t n_chunks, cap_chunks, next_chunk, completed;
    pthread_t *workers; int32_t n_workers;
    pthread_mutex_t mu;
    pthread_cond_t go, done;
    int64_t gen;
    int32_t active, stop, io_error;
    char io_msg[200];
};

/* ---- the mappings ---------------------------------------------------------------------- */

int fp_set_regions(fp_file *t, int32_t n, const int64_t *file_off, const int64_t *length,
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
static char *addr_of(const fp_file *t, int64_t off, int64_t len) {
    for (int32_t i = 0; i < t->n_regions; i++) {
        const region *r = &t->regions[i];
        if (r->copy == 0 && r->off <= off && off + len <= r->off + r->len)
            return (char *) (intptr_t) (r->addr + (off - r->off));
    }
    return NULL;
}

/* every page of file bytes [off, off + len) is in the page cache (mincore on copy 0) */
int fp_resident(const fp_file *t, int64_t off, int64_t len) {
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

int fp_advise(const fp_file *t, int64_t off, int64_t len) {
    char *addr = addr_of(t, off, len);
    if (addr == NULL) return -1;
    const uintptr_t lo = (uintptr_t) addr & ~(uintptr_t) (t->page - 1);
    return madvise((void *) lo, (size_t) ((uintptr_t) addr + (uintptr_t) len - lo),
                   MADV_WILLNEED) == 0 ? 0 : -1;
}

/* ---- reads ----------------------------------------------------------------------------- */

static void io_fail(fp_file *t, const char *what, int64_t off, int err) {
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

static int read_whole(fp_file *t, int64_t off, int64_t len, char *buf) {
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
static int read_chunk(fp_file *t, const chunk *c, char *buf) {
    if (c->advised) {
        ssize_t got;
        do got = pread(t->fd, buf, 1, c->off + c->len - 1); while (got < 0 && errno == EINTR);
        if (got <= 0) {
            io_fail(t, got < 0 ? "read failed" : "short read", c->off + c->len - 1,
                    got < 0 ? errno : 0);
            return -1;
        }
        if (fp_resident(t, c->off, c->len)) return 0;
    }
    return read_whole(t, c->off, c->len, buf);
}

static void run_chunks(fp_file *t, char *buf) {
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
    fp_file *t = arg;
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

static int push_chunk(fp_file *t, int64_t off, int64_t len, int32_t advised) {
    if (array_grow((void **) &t->chunks, &t->cap_chunks, t->n_chunks + 1, sizeof *t->chunks))
        return -1;
    t->chunks[t->n_chunks++] = (chunk) {off, len, advised};
    return 0;
}

int fp_read(fp_file *t, const int64_t *off, const int64_t *len, int32_t n, char *msg,
            size_t msg_bytes) {
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
        const int32_t advised = fp_advise(t, off[i], len[i]) == 0;
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
    if (failed) snprintf(msg, msg_bytes, "%s", t->io_msg);
    pthread_mutex_unlock(&t->mu);
    return failed ? -1 : 0;
nomem:
    snprintf(msg, msg_bytes, "out of memory");
    return -1;
}

/* ---- drops ----------------------------------------------------------------------------- */

void fp_drop(fp_file *t, int64_t off, int64_t len, int32_t unlock) {
    for (int32_t j = 0; j < t->n_regions; j++) {          /* a mapped page cannot leave */
        const region *r = &t->regions[j];
        const int64_t lo = off > r->off ? off : r->off;
        const int64_t hi = off + len < r->off + r->len ? off + len : r->off + r->len;
        if (lo >= hi) continue;
        void *a = (void *) (intptr_t) (r->addr + (lo - r->off));
        if (unlock) munlock(a, (size_t) (hi - lo));
        madvise(a, (size_t) (hi - lo), MADV_DONTNEED);
    }
    posix_fadvise(t->fd, off, len, POSIX_FADV_DONTNEED);
}

/* ---- lifetime -------------------------------------------------------------------------- */

int64_t fp_page_size(const fp_file *t) { return t->page; }
void fp_set_fd(fp_file *t, int32_t fd) { t->fd = fd; }

fp_file *fp_create(int32_t fd, int32_t threads) {
    if (threads < 1) return NULL;
    fp_file *t = calloc(1, sizeof *t);
    if (t == NULL) return NULL;
    t->fd = fd;
    t->page = sysconf(_SC_PAGESIZE);
    pthread_mutex_init(&t->mu, NULL);
    pthread_cond_init(&t->go, NULL);
    pthread_cond_init(&t->done, NULL);
    t->workers = calloc((size_t) threads, sizeof *t->workers);
    if (t->workers == NULL) {
        fp_free(t);
        return NULL;
    }
    for (int32_t i = 0; i < threads - 1; i++) {      /* + the calling thread = threads */
        if (pthread_create(&t->workers[i], NULL, worker, t) != 0) break;
        t->n_workers++;
    }
    return t;
}

void fp_free(fp_file *t) {
    if (t == NULL) return;
    pthread_mutex_lock(&t->mu);
    t->stop = 1;
    pthread_cond_broadcast(&t->go);
    pthread_mutex_unlock(&t->mu);
    for (int32_t i = 0; i < t->n_workers; i++) pthread_join(t->workers[i], NULL);
    pthread_mutex_destroy(&t->mu);
    pthread_cond_destroy(&t->go);
    pthread_cond_destroy(&t->done);
    free(t->workers); free(t->regions); free(t->chunks);
    free(t);
}
