/* file_pages: one model file's pages for the RAM tier (tier_io.c): where the file is mapped,
 * whether byte ranges are in the page cache (mincore), parallel reads into it (a pthread pool
 * of threads - 1 workers plus the calling thread) and drops from it. Internal to tier_io.c.
 *
 * Reads: MADV_WILLNEED on copy 0 of the mapping queues every range's reads at once; then per
 * 1 MiB chunk a one-byte pread of its last byte waits for the kernel's read and mincore
 * confirms; a chunk still short (in flight, skipped) or unmapped is read whole with pread.
 * Drops: MADV_DONTNEED on every copy (a mapped page cannot leave), then
 * posix_fadvise(DONTNEED). The Python reference is runtime/ramtier/pager.py.
 */
#ifndef FILE_PAGES_H
#define FILE_PAGES_H
#include <stddef.h>
#include <stdint.h>

typedef struct fp_file fp_file;

fp_file *fp_create(int32_t fd, int32_t threads);
void fp_free(fp_file *f);
void fp_set_fd(fp_file *f, int32_t fd);
/* n regions (file offset, bytes, address, copy); copy 0 is read through, all are unmapped */
int fp_set_regions(fp_file *f, int32_t n, const int64_t *file_off, const int64_t *length,
                   const int64_t *addr, const int32_t *copy);
int64_t fp_page_size(const fp_file *f);
int fp_resident(const fp_file *f, int64_t off, int64_t len);   /* every page in the cache */
/* read n ranges into the page cache and wait; 0, or -1 with the reason in msg */
int fp_read(fp_file *f, const int64_t *off, const int64_t *len, int32_t n, char *msg,
            size_t msg_bytes);
/* queue the reads of file bytes [off, off + len) (MADV_WILLNEED on copy 0) and return at once;
 * 0, or -1 when no copy maps them all or the kernel refused */
int fp_advise(const fp_file *f, int64_t off, int64_t len);
/* page-aligned file bytes leave every mapping (munlocked first with `unlock`) and the cache */
void fp_drop(fp_file *f, int64_t off, int64_t len, int32_t unlock);

#endif
