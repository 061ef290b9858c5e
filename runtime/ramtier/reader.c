/* reader: see reader.h. The Python reference of what is read is Pager.page_in
 * (runtime/ramtier/pager.py): the same bytes, read synchronously. */
#define _GNU_SOURCE
#include "reader.h"

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#ifndef MADV_POPULATE_READ
#define MADV_POPULATE_READ 22                    /* Linux 5.14 */
#endif

typedef struct {
    int64_t off, len;
    int64_t next;            /* bytes of the job claimed by a reader (== len: nothing left) */
    int32_t running;         /* chunks being read */
    uint8_t queued;          /* bit p: in queue p */
    uint8_t fresh;           /* queued since its last rd_use */
    uint8_t failed;
} job;

typedef struct { int32_t *v; int32_t head, n, cap; } ring;   /* job ids, FIFO */

struct rd_reader {
    fp_file *fp;
    int fd;
    int64_t page;
    job *jobs;
    int32_t n_jobs;
    ring q[2];               /* RD_DEMAND, RD_PREFETCH: a job at most once in each */
    pthread_t *workers;
    int32_t n_workers;
    pthread_mutex_t mu;
    pthread_cond_t work, done;
    int stop, populate;
    int64_t chunk;           /* bytes per request (<= RD_CHUNK_BYTES) */
    char err[200];
    int has_err;
    rd_stats st;
    int32_t waiting;         /* threads in rd_wait */
    int32_t idle;            /* workers waiting for work */
    int64_t wait_t0;
};

static int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t) ts.tv_sec * 1000000000 + ts.tv_nsec;
}

/* ---- queues (under mu) ------------------------------------------------------------------ */

static void push(rd_reader *r, int32_t p, int32_t j) {
    ring *q = &r->q[p];
    if (r->jobs[j].queued & (1 << p)) return;
    q->v[(q->head + q->n) % q->cap] = j;      /* cap = n_jobs: never full (at most once each) */
    q->n++;
    r->jobs[j].queued |= (uint8_t) (1 << p);
}

static int job_done(const job *b) { return b->next >= b->len && b->running == 0; }

/* the next chunk to read from the queues, demand first: its job (claimed), or -1. Jobs with
 * nothing left to claim leave their queue here. */
static int32_t claim_queued(rd_reader *r, int64_t *off, int64_t *len) {
    for (int32_t p = 0; p < 2; p++) {
        ring *q = &r->q[p];
        while (q->n) {
            const int32_t j = q->v[q->head];
            job *b = &r->jobs[j];
            if (b->next < b->len) {
                *off = b->off + b->next;
                *len = b->len - b->next < r->chunk ? b->len - b->next : r->chunk;
                b->next += *len;
                b->running++;
                return j;
            }
            b->queued &= (uint8_t) ~(1 << p);
            q->head = (q->head + 1) % q->cap;
            q->n--;
        }
    }
    return -1;
}

/* ---- one chunk -------------------------------------------------------------------------- */

static void fail_locked(rd_reader *r, const char *what, int64_t off, int err) {
    if (r->has_err) return;
    r->has_err = 1;
    if (err) snprintf(r->err, sizeof r->err, "%s at offset %lld: %s", what, (long long) off,
                      strerror(err));
    else snprintf(r->err, sizeof r->err, "%s at offset %lld (the model file was truncated?)",
                  what, (long long) off);
}

/* [off, off + len) into the page cache and mapped into the model's mapping. Where that mapping
 * covers it: readahead(2) asks the kernel for exactly those bytes (no copy: they go straight
 * into the page cache; one request of at most max(the device's max request, read-ahead), which
 * RD_CHUNK_BYTES stays within: rd_set_chunk), then MADV_POPULATE_READ waits for them and maps
 * them (Linux 5.14). Otherwise, or when that fails (an I/O error or a file cut short shows as
 * EFAULT there), pread reads them through a buffer and says what went wrong. 0, or the errno
 * (EIO...) / -1 for a short read. */
static int read_chunk(rd_reader *r, int64_t off, int64_t len, char *buf, int64_t *bad_off) {
    const int64_t start = off, end = off + len;
    char *addr = __atomic_load_n(&r->populate, __ATOMIC_RELAXED) ? fp_address(r->fp, off, len)
                                                                : NULL;
    if (addr != NULL) {
        const uintptr_t lo = (uintptr_t) addr & ~(uintptr_t) (r->page - 1);
        const size_t span = (size_t) ((uintptr_t) addr + (uintptr_t) len - lo);
        if (readahead(r->fd, off, (size_t) len) == 0 &&
            madvise((void *) lo, span, MADV_POPULATE_READ) == 0)
            return 0;
        if (errno == EINVAL)                  /* no MADV_POPULATE_READ: pread from now on */
            __atomic_store_n(&r->populate, 0, __ATOMIC_RELAXED);
    }
    while (off < end) {
        const ssize_t got = pread(r->fd, buf, (size_t) (end - off), off);
        if (got < 0 && errno == EINTR) continue;
        if (got <= 0) {
            *bad_off = off;
            return got < 0 ? errno : -1;
        }
        off += got;
    }
    (void) start;
    return 0;
}

/* read one claimed chunk of job j (mu held on entry and on return) */
static void run_chunk(rd_reader *r, int32_t j, int64_t off, int64_t len, char *buf) {
    pthread_mutex_unlock(&r->mu);
    int64_t bad = 0;
    const int rc = buf ? read_chunk(r, off, len, buf, &bad) : ENOMEM;
    pthread_mutex_lock(&r->mu);
    job *b = &r->jobs[j];
    b->running--;
    if (rc == 0) r->st.read_bytes += len;
    else {
        b->failed = 1;
        fail_locked(r, rc > 0 ? "read failed" : "short read", rc == ENOMEM ? off : bad,
                    rc > 0 ? rc : 0);
    }
    if (job_done(b)) pthread_cond_broadcast(&r->done);
}

/* the calling thread never preempts the one it wakes it (SCHED_BATCH: no wakeup preemption):
 * queueing a layer's reads must not hand the decode thread's core to a dozen readers */
void rd_batch_thread(void) {
    struct sched_param sp = {0};
    pthread_setschedparam(pthread_self(), SCHED_BATCH, &sp);
}

static void *worker(void *arg) {
    rd_reader *r = arg;
    rd_batch_thread();
    char *buf = malloc(RD_CHUNK_BYTES);
    pthread_mutex_lock(&r->mu);
    for (;;) {
        int64_t off = 0, len = 0;
        int32_t j;
        while (!r->stop && (j = claim_queued(r, &off, &len)) < 0) {
            r->idle++;
            pthread_cond_wait(&r->work, &r->mu);
            r->idle--;
        }
        if (r->stop) break;
        run_chunk(r, j, off, len, buf);
    }
    pthread_mutex_unlock(&r->mu);
    free(buf);
    return NULL;
}

/* a buffer for the threads that read while they wait (ggml's, the decode thread) */
static char *thread_buffer(void) {
    static __thread char *buf;
    if (buf == NULL) buf = malloc(RD_CHUNK_BYTES);
    return buf;
}

/* ---- the API ---------------------------------------------------------------------------- */

/* queue job j (mu held); the chunks it adds */
static int64_t queue_locked(rd_reader *r, int32_t j, int32_t p) {
    job *b = &r->jobs[j];
    if (job_done(b)) {                         /* (re)start it */
        b->next = 0;
        b->failed = 0;
        b->fresh = 1;
        push(r, p, j);
        return (b->len + r->chunk - 1) / r->chunk;
    }
    if (p == 0 && b->next < b->len) push(r, 0, j);   /* a queued prefetch becomes a demand */
    return 0;
}

/* wake as many idle workers as there are new chunks, no more (a broadcast would wake every
 * worker to fight over the lock on a machine with two cores) */
static void wake_locked(rd_reader *r, int64_t chunks) {
    for (int64_t i = 0; i < chunks && i < r->idle; i++) pthread_cond_signal(&r->work);
}

void rd_queue(rd_reader *r, int32_t j, int32_t prio) {
    rd_queue_many(r, &j, 1, prio);
}

void rd_queue_many(rd_reader *r, const int32_t *jobs, int32_t n, int32_t prio) {
    const int32_t p = prio == RD_DEMAND ? 0 : 1;
    pthread_mutex_lock(&r->mu);
    int64_t chunks = 0;
    for (int32_t i = 0; i < n; i++)
        if (jobs[i] >= 0 && jobs[i] < r->n_jobs) chunks += queue_locked(r, jobs[i], p);
    wake_locked(r, p == 0 && chunks == 0 ? 1 : chunks);
    pthread_mutex_unlock(&r->mu);
}

int rd_done(rd_reader *r, int32_t j) {
    pthread_mutex_lock(&r->mu);
    const int done = job_done(&r->jobs[j]);
    pthread_mutex_unlock(&r->mu);
    return done;
}

int rd_use(rd_reader *r, int32_t j) {
    pthread_mutex_lock(&r->mu);
    job *b = &r->jobs[j];
    const int done = job_done(b);
    if (b->fresh) {
        b->fresh = 0;
        if (done) r->st.ready_bytes += b->len;
        else r->st.late_bytes += b->len;
    }
    pthread_mutex_unlock(&r->mu);
    return done;
}

int rd_wait(rd_reader *r, int32_t j) {
    pthread_mutex_lock(&r->mu);
    job *b = &r->jobs[j];
    if (!job_done(b)) {
        r->st.waits++;
        if (r->waiting++ == 0) r->wait_t0 = now_ns();
        while (!job_done(b)) {
            if (b->next < b->len) {           /* read its next chunk here */
                const int64_t off = b->off + b->next;
                const int64_t len = b->len - b->next < r->chunk ? b->len - b->next
                                                                 : r->chunk;
                b->next += len;
                b->running++;
                run_chunk(r, j, off, len, thread_buffer());
            } else {
                pthread_cond_wait(&r->done, &r->mu);
            }
        }
        if (--r->waiting == 0) r->st.wait_ns += now_ns() - r->wait_t0;
    }
    const int failed = b->failed;
    pthread_mutex_unlock(&r->mu);
    return failed ? -1 : 0;
}

void rd_cancel(rd_reader *r, int32_t j) {
    pthread_mutex_lock(&r->mu);
    job *b = &r->jobs[j];
    if (b->next < b->len) b->next = b->len;     /* its queue entries go stale */
    b->fresh = 0;
    while (b->running > 0) pthread_cond_wait(&r->done, &r->mu);
    pthread_mutex_unlock(&r->mu);
}

const char *rd_error(rd_reader *r) {
    pthread_mutex_lock(&r->mu);
    const char *msg = r->has_err ? r->err : NULL;
    pthread_mutex_unlock(&r->mu);
    return msg;
}

void rd_clear_error(rd_reader *r) {
    pthread_mutex_lock(&r->mu);
    r->has_err = 0;
    r->err[0] = '\0';
    pthread_mutex_unlock(&r->mu);
}

int rd_read_now(rd_reader *r, const int64_t *off, const int64_t *len, int32_t n) {
    char *buf = thread_buffer();
    for (int32_t i = 0; i < n; i++)
        for (int64_t at = 0; at < len[i]; at += r->chunk) {
            const int64_t c = len[i] - at < r->chunk ? len[i] - at : r->chunk;
            int64_t bad = 0;
            const int rc = buf ? read_chunk(r, off[i] + at, c, buf, &bad) : ENOMEM;
            pthread_mutex_lock(&r->mu);
            if (rc == 0) r->st.read_bytes += c;
            else fail_locked(r, rc > 0 ? "read failed" : "short read", bad, rc > 0 ? rc : 0);
            pthread_mutex_unlock(&r->mu);
            if (rc != 0) return -1;
        }
    return 0;
}

void rd_get_stats(rd_reader *r, rd_stats *out) {
    pthread_mutex_lock(&r->mu);
    *out = r->st;
    if (r->waiting) out->wait_ns += now_ns() - r->wait_t0;
    pthread_mutex_unlock(&r->mu);
}

void rd_set_chunk(rd_reader *r, int64_t bytes) {
    const int64_t page = r->page;
    bytes = bytes / page * page;
    pthread_mutex_lock(&r->mu);
    r->chunk = bytes < page ? page : bytes > RD_CHUNK_BYTES ? RD_CHUNK_BYTES : bytes;
    pthread_mutex_unlock(&r->mu);
}

void rd_set_fd(rd_reader *r, int32_t fd) {
    pthread_mutex_lock(&r->mu);
    r->fd = fd;
    /* another descriptor's bytes need not be the mapping's: read through it (pread) */
    __atomic_store_n(&r->populate, 0, __ATOMIC_RELAXED);
    posix_fadvise(fd, 0, 0, POSIX_FADV_RANDOM);
    pthread_mutex_unlock(&r->mu);
}

/* ---- lifetime --------------------------------------------------------------------------- */

rd_reader *rd_create(fp_file *fp, int32_t fd, int32_t threads, int32_t n_jobs,
                     const int64_t *off, const int64_t *len) {
    if (threads < 1 || n_jobs < 0) return NULL;
    rd_reader *r = calloc(1, sizeof *r);
    if (r == NULL) return NULL;
    r->fp = fp;
    r->fd = fd;
    r->page = sysconf(_SC_PAGESIZE);
    r->populate = 1;
    r->chunk = RD_CHUNK_BYTES;
    r->n_jobs = n_jobs;
    pthread_mutex_init(&r->mu, NULL);
    pthread_cond_init(&r->work, NULL);
    pthread_cond_init(&r->done, NULL);
    r->jobs = calloc((size_t) (n_jobs ? n_jobs : 1), sizeof *r->jobs);
    for (int32_t p = 0; p < 2; p++) {
        r->q[p].cap = n_jobs ? n_jobs : 1;
        r->q[p].v = malloc((size_t) r->q[p].cap * sizeof *r->q[p].v);
    }
    r->workers = calloc((size_t) threads, sizeof *r->workers);
    if (!r->jobs || !r->q[0].v || !r->q[1].v || !r->workers) {
        rd_free(r);
        return NULL;
    }
    for (int32_t j = 0; j < n_jobs; j++) {
        r->jobs[j].off = off[j];
        r->jobs[j].len = len[j];
        r->jobs[j].next = len[j];             /* nothing to read until queued */
    }
    /* the kernel reads what is asked, no more: a neighbour expert is never read ahead */
    posix_fadvise(fd, 0, 0, POSIX_FADV_RANDOM);
    for (int32_t i = 0; i < threads; i++) {
        if (pthread_create(&r->workers[i], NULL, worker, r) != 0) break;
        r->n_workers++;
    }
    return r;
}

void rd_free(rd_reader *r) {
    if (r == NULL) return;
    pthread_mutex_lock(&r->mu);
    r->stop = 1;
    pthread_cond_broadcast(&r->work);
    pthread_mutex_unlock(&r->mu);
    for (int32_t i = 0; i < r->n_workers; i++) pthread_join(r->workers[i], NULL);
    /* chunks being read by waiting threads finished before those threads returned */
    pthread_mutex_destroy(&r->mu);
    pthread_cond_destroy(&r->work);
    pthread_cond_destroy(&r->done);
    free(r->jobs); free(r->q[0].v); free(r->q[1].v); free(r->workers);
    free(r);
}
