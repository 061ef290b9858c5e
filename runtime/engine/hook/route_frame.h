/* route_frame: the ubatch framing of routing nodes, used by the hook's callback (route_hook.c:
 * its events, by topk node) and by imposed routing (route_impose.c: by logits node). Its own
 * file, below both, so that route_hook.c calls route_impose.c and neither calls back. Private
 * (not part of the API, route_hook.h). */
#ifndef ROUTE_FRAME_H
#define ROUTE_FRAME_H

#include <stdint.h>

/* the ubatches of one decode call, as a node seen once per layer and ubatch frames them: the
 * layers starting over begin the next ubatch; rows trimmed to the outputs (the last layer)
 * are the ubatch's last tokens */
typedef struct { int32_t prev, offset, rows; } ub_frame;   /* prev: the last node's key */

static inline void frame_reset(ub_frame *f) { f->prev = -1; f->offset = f->rows = 0; }

/* the node with graph-order key `key` has `rows` rows */
static inline void frame_node(ub_frame *f, int32_t key, int32_t rows) {
    const int next = key <= f->prev;               /* the next ubatch of the same call */
    if (next) f->offset += f->rows;
    if (next || f->prev < 0) f->rows = rows;
    f->prev = key;
}

/* the position of a `rows`-row node's row 0, counted from the call's first token */
static inline int64_t frame_first(const ub_frame *f, int32_t rows) {
    return f->offset + (f->rows > rows ? f->rows - rows : 0);
}

#endif
