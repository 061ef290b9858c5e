/* route_hook's private parts (route_hook.c: the framing and the callback; route_consumers.c:
 * the consumer list; route_impose.c: imposed routing; route_frame.h: the ubatch framing both
 * the callback and imposed routing use): the hook's struct and the records its files share.
 * Not part of the API (route_hook.h). */
#ifndef ROUTE_HOOK_IMPL_H
#define ROUTE_HOOK_IMPL_H

#include "route_frame.h"
#include "route_hook.h"

#include <stddef.h>
#include <stdint.h>
#include <string.h>

#define MAX_WATCHED 16
#define MAX_CONSUMERS 24
#define NAME_BYTES 64

typedef struct {
    int present, done, has_experts, stage;   /* stage -1: no weights yet */
    int32_t rows;
    int32_t *experts; float *weights; int32_t cap;   /* (rows * k) */
} pending;

/* A consumer of routing events (route_hook.h): stepped with every MoE layer-step before the
 * layer's expert matmuls run (0, or a status `error` turns into the batch's message), ended at
 * every batch's end, a failed one too. One list holds them all, in kind order (the bookkeeping
 * cores, the device caches, the RAM tiers, the observer adapter last): the order they step in
 * and the first error is reported in. */
typedef struct {
    int32_t layer, phase, turn, n_rows;
    int64_t first_step;
    const int32_t *experts;                         /* (n_rows * k) routing order */
    const float *weights;                           /* (n_rows * k) */
    int32_t n;                                      /* n_rows * k */
} step_event;
typedef struct consumer consumer;
typedef struct {                                    /* one per RH_CONSUMER_*, in that order */
    int (*step)(consumer *u, const step_event *e);
    int (*batch_end)(consumer *u);                 /* 0, or an error found late (a read) */
    void (*error)(const consumer *u, int32_t layer, int status, char *msg, int32_t cap);
} consumer_kind;
struct consumer {
    const consumer_kind *kind;
    void *obj;                                      /* rc_core, dc_cache, rt_tier or rh_hook */
    int64_t held;                                   /* a bookkeeping core's lease (rc_step) */
};

typedef struct {
    int32_t layer, phase, first_step, turn, n_rows;
    int64_t at;                                     /* offset into the event arrays */
} ev_rec;

struct rh_hook {
    int32_t mode;
    rh_eval_cb watch_cb;                            /* watched nodes' data (rh_set_watch) */
    void *watch_user;
    int32_t n_watched;
    char watched[MAX_WATCHED][NAME_BYTES];
    rh_event_cb observer;                           /* the synchronous observers' adapter */
    void *observer_user;
    rh_tensor_get tensor_get;
    size_t type_off, ne_off, nb_off, name_off;
    int32_t n_layer, k, last_layer;
    uint8_t *is_moe;
    int8_t *final_stage;                            /* (n_layer,) -1 unknown */
    const void **topk_node;                         /* (n_layer,) this graph's topk tensor */
    pending *pend;                                  /* (n_layer,) */
    int32_t *rows;                                  /* (n_layer,) rows routed this batch */
    /* batch framing */
    int in_batch, strict;
    int32_t phase, turn, n_tokens, n_outputs;
    ub_frame frame;                                 /* the events' ubatches (by topk node) */
    int64_t batch_start;
    /* the consumers every event steps, in kind order */
    consumer consumers[MAX_CONSUMERS];
    int32_t n_consumers;
    /* events of this batch */
    ev_rec *events; int32_t n_events, cap_events;
    int32_t *ev_experts; float *ev_weights; int64_t n_ev_elems, cap_ev_elems;
    /* scratch for a tensor read */
    unsigned char *raw; size_t cap_raw;
    int32_t *tmp_i; float *tmp_f; int64_t cap_tmp;
    /* imposed routing (rh_set_route): the router logits per (position, layer), set at each
     * ffn_moe_logits(_biased) node so that llama.cpp's own top-k selects the given experts */
    rh_tensor_set tensor_set;
    int64_t route_n_pos;
    int32_t route_n_expert;
    int32_t *route_experts;                         /* (route_n_pos, n_layer, k) */
    float *route_logits;                            /* (route_n_pos, n_layer, k) */
    float *route_row;                               /* (rows * n_expert) scratch */
    int64_t cap_route_row;
    int64_t route_start;                            /* position of the batch's first token */
    int route_error;                                /* this batch's: route_msg says which */
    char route_msg[160];
    ub_frame route_frame;                           /* by logits node: 2 * layer + biased */
    int error;
    char msg[256];
};

/* a ggml_tensor's type, ne and nb, read through the offsets the hook was given */
static inline int32_t tensor_meta(const rh_hook *h, const void *t, int64_t ne[4], size_t nb[4]) {
    const char *base = (const char *) t;
    int32_t type;
    memcpy(&type, base + h->type_off, sizeof type);
    memcpy(ne, base + h->ne_off, 4 * sizeof *ne);
    memcpy(nb, base + h->nb_off, 4 * sizeof *nb);
    return type;
}

/* route_impose.c: at a router-logits node with a route set, write the imposed logits; -1 when
 * `tensor` is no such node (the callback goes on), else the callback's answer */
int rh_impose_node(rh_hook *h, void *tensor, bool ask);

#endif
