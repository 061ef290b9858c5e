/* order_heap: the heap order's inline parts (order.c), and order_add / order_discard, which
 * every touched key takes twice per access: inline in the files of the hot path so that the
 * heap, by far the most common order, is called directly (private; see core_impl.h). */
#ifndef ORDER_HEAP_H
#define ORDER_HEAP_H
#include "core_impl.h"

/* (score, last seq, flat) of a < b */
static inline int key_less(const rc_core *c, int32_t o, int32_t a, int32_t b) {
    if (c->evict[o].score_is_last_seq) {
        const int64_t la = c->last_seq[a], lb = c->last_seq[b];
        return la != lb ? la < lb : a < b;
    }
    const rc_score_fn score = c->evict[o].score;
    const double sa = score(c, o, a), sb = score(c, o, b);
    if (sa != sb) return sa < sb;
    if (c->last_seq[a] != c->last_seq[b]) return c->last_seq[a] < c->last_seq[b];
    return a < b;
}

static inline void heap_swap(heap *h, int32_t i, int32_t j) {
    int32_t a = h->items[i], b = h->items[j];
    h->items[i] = b; h->items[j] = a;
    h->pos[b] = i; h->pos[a] = j;
}

static inline void sift_up(const rc_core *c, int32_t o, heap *h, int32_t i) {
    while (i > 0) {
        int32_t p = (i - 1) / 2;
        if (!key_less(c, o, h->items[i], h->items[p])) break;
        heap_swap(h, i, p);
        i = p;
    }
}

static inline void sift_down(const rc_core *c, int32_t o, heap *h, int32_t i) {
    for (;;) {
        int32_t l = 2 * i + 1, r = l + 1, m = i;
        if (l < h->n && key_less(c, o, h->items[l], h->items[m])) m = l;
        if (r < h->n && key_less(c, o, h->items[r], h->items[m])) m = r;
        if (m == i) return;
        heap_swap(h, i, m);
        i = m;
    }
}

/* the membership set both orders keep (the heap's array, unsorted for next-visit) */
static inline int set_push(heap *h, int32_t f) {
    if (array_grow((void **) &h->items, &h->cap, (int64_t) h->n + 1, sizeof *h->items))
        return -1;
    h->items[h->n] = f;
    h->pos[f] = h->n++;
    return 0;
}

/* f leaves the set; the key moved into its place (-1: none) */
static inline int32_t set_remove(heap *h, int32_t f) {
    const int32_t i = h->pos[f];
    h->n--;
    int32_t moved = -1;
    if (i != h->n) {
        moved = h->items[h->n];
        heap_swap(h, i, h->n);
    }
    h->pos[f] = -1;
    return moved;
}

static inline int heap_push(rc_core *c, pool *p, int32_t o, int32_t f) {
    heap *h = &p->h[o];
    if (h->pos[f] >= 0) return 0;
    if (set_push(h, f) < 0) return -1;
    sift_up(c, o, h, h->n - 1);
    return 0;
}

static inline void heap_remove(rc_core *c, pool *p, int32_t o, int32_t f) {
    heap *h = &p->h[o];
    if (h->pos[f] < 0) return;
    const int32_t i = h->pos[f], moved = set_remove(h, f);
    if (moved >= 0) {
        sift_up(c, o, h, i);
        sift_down(c, o, h, h->pos[moved]);
    }
}

/* every touched key leaves and rejoins its orders: the heap, by far the most common order,
 * is called directly (a call through the table costs the hot path a few percent) */
static inline int order_add(rc_core *c, int32_t f) {
    pool *p = pool_of(c, f);
    for (int32_t o = 0; o < c->pol.n_orders; o++) {
        const rc_order_ops *ops = order_ops(c, o);
        if ((ops == &rc_heap_order ? heap_push(c, p, o, f) : ops->push(c, p, o, f)) < 0)
            return -1;
    }
    return 0;
}

static inline void order_discard(rc_core *c, int32_t f) {
    pool *p = pool_of(c, f);
    for (int32_t o = 0; o < c->pol.n_orders; o++) {
        const rc_order_ops *ops = order_ops(c, o);
        if (ops == &rc_heap_order) heap_remove(c, p, o, f);
        else ops->remove(c, p, o, f);
    }
}

#endif
