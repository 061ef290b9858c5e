/* grow: the one array-growth helper of the C library's parts (the residency core, the routing
 * hook, the RAM tier's layer_step.c). Internal: not part of the cdef. */
#ifndef GROW_H
#define GROW_H
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>

/* make room for `need` items of `item` bytes in *p (capacity *cap, doubled from 64); 0 or -1
 * (out of memory: *p and *cap unchanged) */
static inline int array_grow(void **p, int64_t *cap, int64_t need, size_t item) {
    if (need <= *cap) return 0;
    int64_t c = *cap ? *cap : 64;
    while (c < need) c *= 2;
    void *q = realloc(*p, (size_t) c * item);
    if (q == NULL) return -1;
    *p = q;
    *cap = c;
    return 0;
}

#endif
