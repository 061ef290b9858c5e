/* file_pages: see file_pages.h. */
#define _GNU_SOURCE
#include "file_pages.h"

#include <fcntl.h>
#include <pthread.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <unistd.h>

typedef struct { int64_t off, len, addr; int32_t copy; } region;

struct fp_file {
    int fd;
    int64_t page;
    /* the mappings: replaced (rarely, from Python) while readers and ggml's threads look
     * addresses up, hence the lock */
    pthread_rwlock_t lock;
    region *regions; int32_t n_regions;
};

/* ---- the mappings ---------------------------------------------------------------------- */

int fp_set_regions(fp_file *t, int32_t n, const int64_t *file_off, const int64_t *length,
                   const int64_t *addr, const int32_t *copy) {
    region *r = n ? malloc((size_t) n * sizeof *r) : NULL;
    if (n && r == NULL) return -1;
    for (int32_t i = 0; i < n; i++) {
        r[i].off = file_off[i]; r[i].len = length[i]; r[i].addr = addr[i]; r[i].copy = copy[i];
    }
    pthread_rwlock_wrlock(&t->lock);
    region *old = t->regions;
    t->regions = r;
    t->n_regions = n;
    pthread_rwlock_unlock(&t->lock);
    free(old);
    return 0;
}

static char *addr_locked(const fp_file *t, int64_t off, int64_t len) {
    for (int32_t i = 0; i < t->n_regions; i++) {
        const region *r = &t->regions[i];
        if (r->copy == 0 && r->off <= off && off + len <= r->off + r->len)
            return (char *) (intptr_t) (r->addr + (off - r->off));
    }
    return NULL;
}

char *fp_address(const fp_file *t, int64_t off, int64_t len) {
    pthread_rwlock_rdlock((pthread_rwlock_t *) &t->lock);
    char *a = addr_locked(t, off, len);
    pthread_rwlock_unlock((pthread_rwlock_t *) &t->lock);
    return a;
}

int64_t fp_offset_of(const fp_file *t, const void *addr) {
    const int64_t a = (int64_t) (intptr_t) addr;
    int64_t off = -1;
    pthread_rwlock_rdlock((pthread_rwlock_t *) &t->lock);
    for (int32_t i = 0; i < t->n_regions; i++) {
        const region *r = &t->regions[i];
        if (r->addr <= a && a < r->addr + r->len) {
            off = r->off + (a - r->addr);
            break;
        }
    }
    pthread_rwlock_unlock((pthread_rwlock_t *) &t->lock);
    return off;
}

/* every page of file bytes [off, off + len) is in the page cache (mincore on copy 0) */
int fp_resident(const fp_file *t, int64_t off, int64_t len) {
    pthread_rwlock_rdlock((pthread_rwlock_t *) &t->lock);
    int ok = 1;
    char *addr = addr_locked(t, off, len);
    if (addr == NULL) ok = 0;
    const uintptr_t lo = (uintptr_t) addr & ~(uintptr_t) (t->page - 1);
    const uintptr_t hi = (uintptr_t) addr + (uintptr_t) len;
    unsigned char vec[256];
    for (uintptr_t at = lo; ok && at < hi;) {
        size_t n_pages = (hi - at + (uintptr_t) t->page - 1) / (uintptr_t) t->page;
        if (n_pages > sizeof vec) n_pages = sizeof vec;
        if (mincore((void *) at, n_pages * (size_t) t->page, vec) != 0) { ok = 0; break; }
        for (size_t i = 0; i < n_pages; i++)
            if (!(vec[i] & 1)) { ok = 0; break; }
        at += n_pages * (uintptr_t) t->page;
    }
    pthread_rwlock_unlock((pthread_rwlock_t *) &t->lock);
    return ok;
}

/* ---- drops ----------------------------------------------------------------------------- */

void fp_drop(fp_file *t, int64_t off, int64_t len, int32_t unlock) {
    pthread_rwlock_rdlock(&t->lock);
    for (int32_t j = 0; j < t->n_regions; j++) {          /* a mapped page cannot leave */
        const region *r = &t->regions[j];
        const int64_t lo = off > r->off ? off : r->off;
        const int64_t hi = off + len < r->off + r->len ? off + len : r->off + r->len;
        if (lo >= hi) continue;
        void *a = (void *) (intptr_t) (r->addr + (lo - r->off));
        if (unlock) munlock(a, (size_t) (hi - lo));
        madvise(a, (size_t) (hi - lo), MADV_DONTNEED);
    }
    pthread_rwlock_unlock(&t->lock);
    posix_fadvise(t->fd, off, len, POSIX_FADV_DONTNEED);
}

/* ---- lifetime -------------------------------------------------------------------------- */

int64_t fp_page_size(const fp_file *t) { return t->page; }
void fp_set_fd(fp_file *t, int32_t fd) { t->fd = fd; }

fp_file *fp_create(int32_t fd) {
    fp_file *t = calloc(1, sizeof *t);
    if (t == NULL) return NULL;
    t->fd = fd;
    t->page = sysconf(_SC_PAGESIZE);
    pthread_rwlock_init(&t->lock, NULL);
    return t;
}

void fp_free(fp_file *t) {
    if (t == NULL) return;
    pthread_rwlock_destroy(&t->lock);
    free(t->regions);
    free(t);
}
