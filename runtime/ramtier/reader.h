/* reader: the RAM tier's reads of the model file into the page cache, off the critical path
 * (tier_io.c owns one). Internal to the RAM tier.
 *
 * A job is a fixed byte range of the file (the tier's expert ranges: job j is
 * [off[j], off[j] + len[j])). A queued job is read by `threads` workers in explicit requests of
 * at most RD_CHUNK_BYTES each (a job's chunks spread over the workers: several requests in
 * flight whatever the kernel's read-ahead): readahead(2) of exactly the chunk (into the page
 * cache, no copy), then MADV_POPULATE_READ on copy 0 of the mapping (waits for the read and
 * maps the pages: the matmul takes no fault); pread through a buffer where that cannot be done.
 * Demand jobs go before prefetch jobs; a thread that waits for a job reads that job's
 * unstarted chunks itself. Our descriptor is FADV_RANDOM, so a pread reads exactly the
 * requested bytes too: nothing depends on `read_ahead_kb` or on page faults.
 *
 *     rd_reader *r = rd_create(fp, fd, threads, n_jobs, off, len);
 *     rd_queue(r, j, RD_DEMAND);       // or RD_PREFETCH; returns at once
 *     ... rd_use(r, j) ... rd_wait(r, j) ...
 *     rd_free(r);
 */
#ifndef READER_H
#define READER_H
#include <stddef.h>
#include <stdint.h>

#include "file_pages.h"

#define RD_CHUNK_BYTES (512 << 10)

typedef struct rd_reader rd_reader;
enum { RD_DEMAND = 0, RD_PREFETCH = 1 };

typedef struct {
    int64_t read_bytes;        /* bytes the workers and waiters read */
    int64_t ready_bytes;       /* bytes of jobs complete when first needed (rd_use) */
    int64_t late_bytes;        /* bytes of jobs still coming when first needed */
    int64_t wait_ns;           /* wall time with at least one thread in rd_wait */
    int64_t waits;             /* rd_wait calls that found the job incomplete */
} rd_stats;

/* fp: the file's mappings (populate); fd: the file, read-only, FADV_RANDOM here */
rd_reader *rd_create(fp_file *fp, int32_t fd, int32_t threads, int32_t n_jobs,
                     const int64_t *off, const int64_t *len);
void rd_free(rd_reader *r);
/* read through `fd` from now on (pread: its bytes need not be the mapping's) */
void rd_set_fd(rd_reader *r, int32_t fd);
/* bytes per request (a multiple of the page, at most RD_CHUNK_BYTES): no more than the device
 * takes in one request (its max_sectors_kb), so readahead(2) reads each chunk whole */
void rd_set_chunk(rd_reader *r, int64_t bytes);
/* queue job j's read (a job queued or being read is not restarted; RD_DEMAND moves a queued
 * prefetch ahead) */
void rd_queue(rd_reader *r, int32_t j, int32_t prio);
/* the same for n jobs, under one lock, waking one worker per new chunk */
void rd_queue_many(rd_reader *r, const int32_t *jobs, int32_t n, int32_t prio);
/* job j has no read queued or running */
int rd_done(rd_reader *r, int32_t j);
/* the first use of job j since it was queued: counts its bytes ready or late; rd_done(j) */
int rd_use(rd_reader *r, int32_t j);
/* return once job j is read (reading its unstarted chunks on this thread meanwhile); 0, or
 * -1 when a read failed (rd_error) */
int rd_wait(rd_reader *r, int32_t j);
/* unqueue job j's unstarted chunks and wait for its running ones (its pages may then leave) */
void rd_cancel(rd_reader *r, int32_t j);
/* the first read error since rd_clear_error (NULL: none) */
const char *rd_error(rd_reader *r);
void rd_clear_error(rd_reader *r);
/* read ad hoc file ranges on this thread (explicit preads, RD_CHUNK_BYTES each); 0, or -1 */
int rd_read_now(rd_reader *r, const int64_t *off, const int64_t *len, int32_t n);
void rd_get_stats(rd_reader *r, rd_stats *out);
/* make the calling thread SCHED_BATCH (the readers and the tier's drop thread are) */
void rd_batch_thread(void);

#endif
