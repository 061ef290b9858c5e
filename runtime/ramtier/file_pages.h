/* file_pages: one model file's pages for the RAM tier (tier_io.c): where the file is mapped,
 * whether byte ranges are in the page cache (mincore), and drops from it. Reads are reader.h's.
 * Internal to the RAM tier.
 *
 * Drops: MADV_DONTNEED on every copy (a mapped page cannot leave), then
 * posix_fadvise(DONTNEED). The Python reference is runtime/ramtier/pager.py.
 */
#ifndef FILE_PAGES_H
#define FILE_PAGES_H
#include <stddef.h>
#include <stdint.h>

typedef struct fp_file fp_file;

fp_file *fp_create(int32_t fd);
void fp_free(fp_file *f);
void fp_set_fd(fp_file *f, int32_t fd);
/* n regions (file offset, bytes, address, copy); copy 0 is read through, all are unmapped */
int fp_set_regions(fp_file *f, int32_t n, const int64_t *file_off, const int64_t *length,
                   const int64_t *addr, const int32_t *copy);
int64_t fp_page_size(const fp_file *f);
int fp_resident(const fp_file *f, int64_t off, int64_t len);   /* every page in the cache */
/* the address of file bytes [off, off + len) in copy 0, or NULL when one region does not map
 * them all */
char *fp_address(const fp_file *f, int64_t off, int64_t len);
/* the file offset of address `addr` in any copy, or -1 when no region maps it */
int64_t fp_offset_of(const fp_file *f, const void *addr);
/* page-aligned file bytes leave every mapping (munlocked first with `unlock`) and the cache */
void fp_drop(fp_file *f, int64_t off, int64_t len, int32_t unlock);

#endif
