/* route_hook: see route_hook.h. The only live framing of routing events; its slow reference
 * is runtime/engine/routing_hook.py (RoutingHook._on_eval and RouteAssembler), which it follows
 * rule for rule; tests run both on the same model
 * and compare the events and the managers' counters. */
#include "route_hook.h"
#include "../native/slot_cache.h"
#include "../ramtier/tier_io.h"
#include "../residency/core/residency_core.h"
#include "../residency/core/grow.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define MAX_WATCHED 16
#define MAX_CONSUMERS 24
#define NAME_BYTES 64

enum { K_NONE = -1, K_TOPK = 0, K_WEIGHTS = 1, K_FLUSH = 2, K_PLANES = 3 };
/* the node names the hook reads or flushes on (before "-<layer>"), with their lengths: a node
 * name is matched by its length first (cb_eval asks about every node of every graph) */
typedef struct { const char *name; size_t len; int kind, stage; } node_name;
static const node_name k_names[] = {
    {"ffn_moe_topk", 12, K_TOPK, -1},
    {"ffn_moe_weights", 15, K_WEIGHTS, 0},           /* the weight stages, in graph order */
    {"ffn_moe_weights_softmax", 23, K_WEIGHTS, 1},
    {"ffn_moe_weights_norm", 20, K_WEIGHTS, 2},
    {"ffn_moe_weights_scaled", 22, K_WEIGHTS, 3},
    {"ffn_moe_weighted", 16, K_FLUSH, -1},           /* the first nodes after the weights */
    {"ffn_moe_gate_up", 15, K_FLUSH, -1},
    {"ffn_moe_up", 10, K_FLUSH, -1},
    {"ffn_moe_gate", 12, K_FLUSH, -1},
    /* a device cache's view of its id planes (patched graph): after the final weights, before
     * the copy every reader reads; a layer not flushed yet (the first batch, final stage
     * unknown) flushes there, at a data callback, so its planes are written before that copy */
    {"ffn_moe_planes", 14, K_PLANES, -1},
};

typedef struct {
    int present, done, has_experts, stage;   /* stage -1: no weights yet */
    int32_t rows;
    int32_t *experts; float *weights; int32_t cap;   /* (rows * k) */
} pending;

/* the ubatches of one decode call, as a node seen once per layer and ubatch frames them: the
 * layers starting over begin the next ubatch; rows trimmed to the outputs (the last layer)
 * are the ubatch's last tokens */
typedef struct { int32_t prev, offset, rows; } ub_frame;   /* prev: the last node's key */

static void frame_reset(ub_frame *f) { f->prev = -1; f->offset = f->rows = 0; }

/* the node with graph-order key `key` has `rows` rows */
static void frame_node(ub_frame *f, int32_t key, int32_t rows) {
    const int next = key <= f->prev;               /* the next ubatch of the same call */
    if (next) f->offset += f->rows;
    if (next || f->prev < 0) f->rows = rows;
    f->prev = key;
}

/* the position of a `rows`-row node's row 0, counted from the call's first token */
static int64_t frame_first(const ub_frame *f, int32_t rows) {
    return f->offset + (f->rows > rows ? f->rows - rows : 0);
}

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
typedef struct {
    int kind;                                       /* RH_CONSUMER_* */
    int (*step)(consumer *u, const step_event *e);
    void (*batch_end)(consumer *u);
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

rh_hook *rh_create(int32_t n_layer, const uint8_t *is_moe, int32_t n_expert_used,
                   rh_tensor_get tensor_get, size_t type_off, size_t ne_off, size_t nb_off,
                   size_t name_off) {
    if (n_layer <= 0 || n_expert_used <= 0 || tensor_get == NULL) return NULL;
    rh_hook *h = calloc(1, sizeof *h);
    if (h == NULL) return NULL;
    h->n_layer = n_layer;
    h->k = n_expert_used;
    h->last_layer = n_layer - 1;
    h->mode = RH_NATIVE;
    h->tensor_get = tensor_get;
    h->type_off = type_off; h->ne_off = ne_off; h->nb_off = nb_off; h->name_off = name_off;
    h->is_moe = malloc((size_t) n_layer);
    h->final_stage = malloc((size_t) n_layer);
    h->topk_node = calloc((size_t) n_layer, sizeof *h->topk_node);
    h->pend = calloc((size_t) n_layer, sizeof *h->pend);
    h->rows = calloc((size_t) n_layer, sizeof *h->rows);
    if (!h->is_moe || !h->final_stage || !h->topk_node || !h->pend || !h->rows) {
        rh_free(h);
        return NULL;
    }
    memcpy(h->is_moe, is_moe, (size_t) n_layer);
    memset(h->final_stage, -1, (size_t) n_layer);
    return h;
}

void rh_free(rh_hook *h) {
    if (h == NULL) return;
    if (h->pend)
        for (int32_t l = 0; l < h->n_layer; l++) {
            free(h->pend[l].experts);
            free(h->pend[l].weights);
        }
    free(h->is_moe); free(h->final_stage); free(h->topk_node); free(h->pend); free(h->rows);
    free(h->events); free(h->ev_experts); free(h->ev_weights); free(h->raw);
    free(h->tmp_i); free(h->tmp_f);
    free(h->route_experts); free(h->route_logits); free(h->route_row);
    free(h);
}

int rh_set_watch(rh_hook *h, rh_eval_cb cb, void *user_data, const char *const *names,
                 int32_t n) {
    if (n < 0 || n > MAX_WATCHED) return -1;
    for (int32_t i = 0; i < n; i++)
        if (strncmp(names[i], "ffn_moe_", 8) != 0 || strlen(names[i]) >= NAME_BYTES) return -1;
    for (int32_t i = 0; i < n; i++) strcpy(h->watched[i], names[i]);
    h->n_watched = n;
    h->watch_cb = cb;
    h->watch_user = user_data;
    return 0;
}

void rh_set_mode(rh_hook *h, int32_t mode) { h->mode = mode; }

void rh_route_batch(rh_hook *h, int64_t first_step) {
    h->route_start = first_step;
    frame_reset(&h->route_frame);
    h->route_error = 0;
}

const char *rh_route_error(const rh_hook *h) { return h->route_error ? h->route_msg : NULL; }

static void route_fail(rh_hook *h, const char *msg) {
    if (!h->route_error) snprintf(h->route_msg, sizeof h->route_msg, "%s", msg);
    h->route_error = 1;
}

int rh_set_route(rh_hook *h, rh_tensor_set tensor_set, int64_t n_pos, int32_t n_expert,
                 const int32_t *experts, const float *logits) {
    free(h->route_experts); free(h->route_logits);
    h->route_experts = NULL; h->route_logits = NULL; h->route_n_pos = 0;
    if (n_pos == 0) return 0;                       /* off */
    if (n_pos < 0 || n_expert <= 0 || tensor_set == NULL) return -1;
    const size_t n = (size_t) n_pos * (size_t) h->n_layer * (size_t) h->k;
    for (size_t i = 0; i < n; i++) {
        const int32_t layer = (int32_t) (i / (size_t) h->k % (size_t) h->n_layer);
        if (h->is_moe[layer] && (experts[i] < 0 || experts[i] >= n_expert ||
                                 !(logits[i] > -1.0e4f)))
            return -1;
    }
    h->route_experts = malloc(n * sizeof *h->route_experts);
    h->route_logits = malloc(n * sizeof *h->route_logits);
    if (h->route_experts == NULL || h->route_logits == NULL) {
        free(h->route_experts); free(h->route_logits);
        h->route_experts = NULL; h->route_logits = NULL;
        return -1;
    }
    memcpy(h->route_experts, experts, n * sizeof *experts);
    memcpy(h->route_logits, logits, n * sizeof *logits);
    h->tensor_set = tensor_set;
    h->route_n_expert = n_expert;
    h->route_n_pos = n_pos;
    return 0;
}

/* ---- consumers ---------------------------------------------------------------------------- */

/* a bookkeeping core: the decisions, nothing moved */
static int core_step(consumer *u, const step_event *e) {
    rc_result r;
    return rc_step(u->obj, &u->held, e->layer, e->experts, e->n, e->phase, &r);
}
static void core_end(consumer *u) { rc_step_end(u->obj, &u->held); }
static void core_error(const consumer *u, int32_t layer, int status, char *msg, int32_t cap) {
    (void) u;
    rc_step_message(msg, cap, "", layer, status);
}

/* a device cache: copies into slots, the id planes (slot_cache.h; it holds its own lease) */
static int cache_step(consumer *u, const step_event *e) {
    return dc_route(u->obj, e->layer, e->experts, e->n, e->phase);
}
static void cache_end(consumer *u) { dc_batch_end(u->obj); }
static void cache_error(const consumer *u, int32_t layer, int status, char *msg, int32_t cap) {
    (void) u;
    if (status <= -100)
        snprintf(msg, (size_t) cap, "device cache: layer %d: the id planes could not be written "
                 "(moe_cache_route status %d)", layer, -100 - status);
    else
        rc_step_message(msg, cap, "device cache: ", layer, status);
}

/* a RAM tier: back only when the layer's experts are in the page cache (tier_io.h) */
static int tier_step(consumer *u, const step_event *e) {
    return rt_step(u->obj, e->layer, e->experts, e->n, e->phase);
}
static void tier_end(consumer *u) { rt_batch_end(u->obj); }
static void tier_error(const consumer *u, int32_t layer, int status, char *msg, int32_t cap) {
    (void) layer; (void) status;
    snprintf(msg, (size_t) cap, "%s", rt_error(u->obj));
}

/* the synchronous observers (Python's): one adapter, the event handed over as it happens */
static int observer_step(consumer *u, const step_event *e) {
    const rh_hook *h = u->obj;
    return h->observer(e->layer, e->phase, e->first_step, e->turn, e->n_rows, e->experts,
                       e->weights, h->observer_user);
}
static void observer_end(consumer *u) { (void) u; }     /* Python ends its observers' batch */
static void observer_error(const consumer *u, int32_t layer, int status, char *msg,
                           int32_t cap) {
    (void) u; (void) status;
    snprintf(msg, (size_t) cap, "layer %d: a routing observer failed", layer);
}

static const consumer_kind k_kinds[] = {
    [RH_CONSUMER_CORE] = {RH_CONSUMER_CORE, core_step, core_end, core_error},
    [RH_CONSUMER_CACHE] = {RH_CONSUMER_CACHE, cache_step, cache_end, cache_error},
    [RH_CONSUMER_TIER] = {RH_CONSUMER_TIER, tier_step, tier_end, tier_error},
    [RH_CONSUMER_OBSERVER] = {RH_CONSUMER_OBSERVER, observer_step, observer_end, observer_error},
};

static int add_consumer(rh_hook *h, int32_t kind, void *obj) {
    if (kind < 0 || kind > RH_CONSUMER_OBSERVER || obj == NULL ||
        h->n_consumers >= MAX_CONSUMERS)
        return -1;
    int32_t at = h->n_consumers;                    /* after every entry of its kind or before */
    while (at > 0 && h->consumers[at - 1].kind->kind > kind) {
        h->consumers[at] = h->consumers[at - 1];
        at--;
    }
    h->consumers[at] = (consumer) {&k_kinds[kind], obj, 0};
    h->n_consumers++;
    return 0;
}

int rh_add_consumer(rh_hook *h, int32_t kind, void *obj) {
    return kind == RH_CONSUMER_OBSERVER ? -1 : add_consumer(h, kind, obj);
}

void rh_set_observer(rh_hook *h, rh_event_cb cb, void *user_data) {
    rh_clear_consumers(h, RH_CONSUMER_OBSERVER);
    h->observer = cb;
    h->observer_user = user_data;
    if (cb != NULL) add_consumer(h, RH_CONSUMER_OBSERVER, h);
}

void rh_clear_consumers(rh_hook *h, int32_t kind) {
    int32_t n = 0;
    for (int32_t i = 0; i < h->n_consumers; i++)
        if (h->consumers[i].kind->kind != kind) h->consumers[n++] = h->consumers[i];
    h->n_consumers = n;
}

const char *rh_error(const rh_hook *h) { return h->msg; }
int32_t rh_n_events(const rh_hook *h) { return h->n_events; }
int32_t rh_final_stage(const rh_hook *h, int32_t layer) {
    return layer >= 0 && layer < h->n_layer ? h->final_stage[layer] : -1;
}

int64_t rh_events_elems(const rh_hook *h) { return h->n_ev_elems; }

int rh_copy_events(const rh_hook *h, int64_t *meta, int32_t *experts, float *weights) {
    for (int32_t i = 0; i < h->n_events; i++) {
        const ev_rec *e = &h->events[i];
        int64_t *m = meta + 6 * (int64_t) i;
        m[0] = e->layer; m[1] = e->phase; m[2] = e->first_step; m[3] = e->turn;
        m[4] = e->n_rows; m[5] = e->at;
    }
    if (h->n_ev_elems) {
        memcpy(experts, h->ev_experts, (size_t) h->n_ev_elems * sizeof *experts);
        memcpy(weights, h->ev_weights, (size_t) h->n_ev_elems * sizeof *weights);
    }
    return 0;
}

static void fail(rh_hook *h, const char *msg) {
    if (!h->error) {
        h->error = 1;
        snprintf(h->msg, sizeof h->msg, "%s", msg);
    }
}

/* ---- framing (RouteAssembler) ------------------------------------------------------------ */

static void end_consumers(rh_hook *h) {
    for (int32_t i = 0; i < h->n_consumers; i++) {
        consumer *u = &h->consumers[i];
        u->kind->batch_end(u);
    }
}

static void emit(rh_hook *h, int32_t layer, const pending *p, int32_t first) {
    const int64_t n = (int64_t) p->rows * h->k;
    if (h->n_events == h->cap_events) {
        int32_t cap = h->cap_events ? 2 * h->cap_events : 256;
        ev_rec *v = realloc(h->events, (size_t) cap * sizeof *v);
        if (v == NULL) { fail(h, "out of memory"); return; }
        h->events = v;
        h->cap_events = cap;
    }
    int64_t cap_i = h->cap_ev_elems, cap_f = h->cap_ev_elems;
    if (array_grow((void **) &h->ev_experts, &cap_i, h->n_ev_elems + n, sizeof(int32_t)) ||
        array_grow((void **) &h->ev_weights, &cap_f, h->n_ev_elems + n, sizeof(float))) {
        fail(h, "out of memory");
        return;
    }
    h->cap_ev_elems = cap_i < cap_f ? cap_i : cap_f;
    memcpy(h->ev_experts + h->n_ev_elems, p->experts, (size_t) n * sizeof(int32_t));
    memcpy(h->ev_weights + h->n_ev_elems, p->weights, (size_t) n * sizeof(float));
    ev_rec *e = &h->events[h->n_events++];
    e->layer = layer; e->phase = h->phase; e->first_step = first; e->turn = h->turn;
    e->n_rows = p->rows; e->at = h->n_ev_elems;
    h->n_ev_elems += n;
    /* every consumer steps, in list order, before the layer's experts run */
    const step_event ev = {layer, h->phase, h->turn, p->rows, first, p->experts, p->weights,
                           (int32_t) n};
    for (int32_t i = 0; i < h->n_consumers; i++) {
        consumer *u = &h->consumers[i];
        const int rc = u->kind->step(u, &ev);
        if (rc != 0) {
            char msg[256];
            u->kind->error(u, layer, rc, msg, sizeof msg);
            fail(h, msg);
        }
    }
}

static void flush(rh_hook *h, int32_t layer) {
    pending *p = &h->pend[layer];
    if (!p->present || p->done || !p->has_experts) return;
    p->done = 1;
    if (p->stage < 0) {
        char msg[96];
        snprintf(msg, sizeof msg, "layer %d: router weights were not captured", layer);
        fail(h, msg);
        return;
    }
    if (h->final_stage[layer] < 0) h->final_stage[layer] = (int8_t) p->stage;
    h->rows[layer] += p->rows;
    if (p->rows == 0) return;
    /* rows trimmed to the outputs (the last layer) are the ubatch's final tokens */
    emit(h, layer, p, (int32_t) (h->batch_start + frame_first(&h->frame, p->rows)));
}

static void flush_pending(rh_hook *h) {
    for (int32_t l = 0; l < h->n_layer; l++)
        if (h->pend[l].present && !h->pend[l].done) flush(h, l);
}

static int set_pending(pending *p, const int32_t *experts, int32_t rows, int32_t k) {
    const int64_t n = (int64_t) rows * k;
    if (n > p->cap) {
        int32_t *e = realloc(p->experts, (size_t) n * sizeof *e);
        if (e == NULL) return -1;
        p->experts = e;
        float *w = realloc(p->weights, (size_t) n * sizeof *w);
        if (w == NULL) return -1;
        p->weights = w;
        p->cap = (int32_t) n;
    }
    memcpy(p->experts, experts, (size_t) n * sizeof *experts);
    p->rows = rows;
    p->present = 1; p->done = 0; p->has_experts = 1; p->stage = -1;
    return 0;
}

static void on_topk(rh_hook *h, int32_t layer, const int32_t *experts, int32_t rows) {
    if (layer <= h->frame.prev) {                   /* the next ubatch of the same decode */
        flush_pending(h);                           /* (framed in this ubatch) */
        for (int32_t l = 0; l < h->n_layer; l++) h->pend[l].present = 0;
    }
    frame_node(&h->frame, layer, rows);
    if (set_pending(&h->pend[layer], experts, rows, h->k) < 0) fail(h, "out of memory");
}

static void on_weights(rh_hook *h, int32_t layer, int32_t stage, const float *w, int32_t rows) {
    pending *p = &h->pend[layer];
    if (!p->present || stage < p->stage) return;
    if (rows != p->rows) {
        char msg[96];
        snprintf(msg, sizeof msg, "layer %d: %d weight rows for %d routed rows", layer, rows,
                 p->rows);
        fail(h, msg);
        return;
    }
    memcpy(p->weights, w, (size_t) rows * h->k * sizeof *w);
    p->stage = stage;
}

void rh_begin_batch(rh_hook *h, int32_t phase, int64_t first_step, int32_t n_tokens,
                    int32_t n_outputs, int32_t turn, int32_t strict) {
    h->phase = phase; h->batch_start = first_step; h->n_tokens = n_tokens;
    h->n_outputs = n_outputs; h->turn = turn; h->strict = strict;
    frame_reset(&h->frame);
    for (int32_t l = 0; l < h->n_layer; l++) {
        h->pend[l].present = 0;
        h->rows[l] = 0;
    }
    h->n_events = 0;
    h->n_ev_elems = 0;
    h->error = 0;
    h->msg[0] = '\0';
    h->in_batch = 1;
}

int rh_end_batch(rh_hook *h) {
    if (!h->error) flush_pending(h);
    h->in_batch = 0;
    if (!h->error && h->strict)
        for (int32_t l = 0; l < h->n_layer; l++) {
            if (!h->is_moe[l]) continue;
            const int32_t want = l == h->last_layer ? h->n_outputs : h->n_tokens;
            if (h->rows[l] != want) {
                char msg[128];
                snprintf(msg, sizeof msg, "layer %d: routed %d tokens of %d in a %s batch", l,
                         h->rows[l], want,
                         h->phase == 0 ? "prefill" : h->phase == 1 ? "decode" : "mixed");
                fail(h, msg);
                break;
            }
        }
    end_consumers(h);
    return h->error;
}

void rh_abort_batch(rh_hook *h) {
    h->in_batch = 0;
    end_consumers(h);
    h->n_events = 0;
}

/* ---- reading a tensor ---------------------------------------------------------------------- */

/* a ggml_tensor's type, ne and nb, read through the offsets the hook was given */
static int32_t tensor_meta(const rh_hook *h, const void *t, int64_t ne[4], size_t nb[4]) {
    const char *base = (const char *) t;
    int32_t type;
    memcpy(&type, base + h->type_off, sizeof type);
    memcpy(ne, base + h->ne_off, 4 * sizeof *ne);
    memcpy(nb, base + h->nb_off, 4 * sizeof *nb);
    return type;
}

/* the tensor's elements in (ne3, ne2, ne1, ne0) order as int32 or float; the count, or -1 */
static int64_t read_elems(rh_hook *h, const void *t, int want_type, void **out) {
    int64_t ne[4];
    size_t nb[4];
    if (tensor_meta(h, t, ne, nb) != want_type) return -1;
    int64_t n = ne[0] * ne[1] * ne[2] * ne[3];
    if (n <= 0) { *out = want_type == 26 ? (void *) h->tmp_i : (void *) h->tmp_f; return 0; }
    size_t span = 4;
    for (int i = 0; i < 4; i++) span += (size_t) (ne[i] - 1) * nb[i];
    if (span > h->cap_raw) {
        unsigned char *r = realloc(h->raw, span);
        if (r == NULL) return -1;
        h->raw = r;
        h->cap_raw = span;
    }
    h->tensor_get(t, h->raw, 0, span);
    int64_t cap = h->cap_tmp;
    if (n > cap) {
        int64_t cap_i = h->cap_tmp, cap_f = h->cap_tmp;
        if (array_grow((void **) &h->tmp_i, &cap_i, n, 4) ||
            array_grow((void **) &h->tmp_f, &cap_f, n, 4))
            return -1;
        h->cap_tmp = cap_i < cap_f ? cap_i : cap_f;
    }
    unsigned char *dst = want_type == 26 ? (unsigned char *) h->tmp_i : (unsigned char *) h->tmp_f;
    int64_t at = 0;
    for (int64_t i3 = 0; i3 < ne[3]; i3++)
        for (int64_t i2 = 0; i2 < ne[2]; i2++)
            for (int64_t i1 = 0; i1 < ne[1]; i1++) {
                const unsigned char *row = h->raw + i3 * nb[3] + i2 * nb[2] + i1 * nb[1];
                if (nb[0] == 4) {
                    memcpy(dst + at * 4, row, (size_t) ne[0] * 4);
                    at += ne[0];
                } else {
                    for (int64_t i0 = 0; i0 < ne[0]; i0++) memcpy(dst + 4 * at++, row + i0 * nb[0], 4);
                }
            }
    *out = dst;
    return n;
}

/* ---- the callback -------------------------------------------------------------------------- */

static int parse(const char *name, int32_t n_layer, int32_t *layer, int32_t *stage) {
    if (strncmp(name, "ffn_moe_", 8) != 0) return K_NONE;
    const char *dash = strrchr(name, '-');
    if (dash == NULL || dash[1] < '0' || dash[1] > '9') return K_NONE;
    const size_t len = (size_t) (dash - name);
    for (size_t i = 0; i < sizeof k_names / sizeof k_names[0]; i++) {
        const node_name *n = &k_names[i];
        if (n->len != len || memcmp(name, n->name, len) != 0) continue;
        /* derived names ("ffn_moe_topk-3 (reshaped)") end past the layer number */
        char *end;
        const long l = strtol(dash + 1, &end, 10);
        if (*end != '\0' || l >= n_layer) return K_NONE;
        *layer = (int32_t) l;
        *stage = n->stage;
        return n->kind;
    }
    return K_NONE;
}

/* a node rh_set_watch named (exact names: never ggml's derived "x (reshaped)") */
static int watched(const rh_hook *h, const char *name) {
    for (int32_t i = 0; i < h->n_watched; i++)
        if (strncmp(name, h->watched[i], NAME_BYTES) == 0) return 1;
    return 0;
}

static bool eval_native(rh_hook *h, void *tensor, bool ask) {
    const char *name = (const char *) tensor + h->name_off;
    if (strncmp(name, "ffn_moe_", 8) != 0) return false;
    if (h->error) return ask;                /* ask: compute up to here; data: stop the graph */
    if (!h->in_batch) return false;          /* a decode nobody framed */
    int32_t layer = -1, stage = -1;
    const int kind = parse(name, h->n_layer, &layer, &stage);
    if (kind == K_NONE) return watched(h, name) && (ask || h->watch_cb(tensor, ask, h->watch_user));
    if (!h->is_moe[layer]) return false;
    const int final = h->final_stage[layer];
    if (ask) {
        if (kind == K_PLANES) return h->pend[layer].present && !h->pend[layer].done;
        if (kind == K_FLUSH) {
            flush(h, layer);
            return false;
        }
        if (kind == K_TOPK) {
            h->topk_node[layer] = tensor;
            return final < 0;                /* later: read with the final weights */
        }
        return final < 0 || final == stage;
    }
    void *data;
    if (kind == K_PLANES) {
        flush(h, layer);
    } else if (kind == K_TOPK) {
        const int64_t n = read_elems(h, tensor, 26, &data);
        if (n < 0 || n % h->k) { fail(h, "ffn_moe_topk: unexpected tensor"); return false; }
        on_topk(h, layer, (const int32_t *) data, (int32_t) (n / h->k));
    } else if (final < 0) {
        const int64_t n = read_elems(h, tensor, 0, &data);
        if (n < 0 || n % h->k) { fail(h, "router weights: unexpected tensor"); return false; }
        on_weights(h, layer, stage, (const float *) data, (int32_t) (n / h->k));
    } else {
        /* one sync per layer: the topk view is still live here (the expert matmuls read it
         * next), so read it now together with the applied weights */
        if (h->topk_node[layer] == NULL) { fail(h, "ffn_moe_topk was not seen"); return false; }
        int64_t n = read_elems(h, h->topk_node[layer], 26, &data);
        if (n < 0 || n % h->k) { fail(h, "ffn_moe_topk: unexpected tensor"); return false; }
        on_topk(h, layer, (const int32_t *) data, (int32_t) (n / h->k));
        n = read_elems(h, tensor, 0, &data);
        if (n < 0 || n % h->k) { fail(h, "router weights: unexpected tensor"); return false; }
        on_weights(h, layer, stage, (const float *) data, (int32_t) (n / h->k));
        flush(h, layer);
    }
    return true;
}

/* ---- imposed routing ---------------------------------------------------------------------- */

/* "ffn_moe_logits-L" or "ffn_moe_logits_biased-L" (the router's bias, gpt-oss, is added
 * after the first: both are set, the later wins): the layer, or -1; *biased says which */
static int32_t logits_layer(const rh_hook *h, const char *name, int *biased) {
    static const char base[] = "ffn_moe_logits";
    if (strncmp(name, base, sizeof base - 1) != 0) return -1;
    const char *rest = name + sizeof base - 1;
    *biased = strncmp(rest, "_biased", 7) == 0;
    if (*biased) rest += 7;
    if (rest[0] != '-' || rest[1] < '0' || rest[1] > '9') return -1;
    char *end;
    const long l = strtol(rest + 1, &end, 10);
    if (*end != '\0' || l >= h->n_layer || !h->is_moe[l]) return -1;
    return (int32_t) l;
}

/* Write the imposed logits of layer `layer` into `tensor` ((n_expert, rows) f32, contiguous):
 * the trace's experts get their log-weights (descending in slot order), every other expert a
 * floor no softmax, sigmoid or top-k lets through. Rows map to positions as the events do
 * (ub_frame). */
static bool impose(rh_hook *h, void *tensor, int32_t layer, int biased) {
    int64_t ne[4];
    size_t nb[4];
    const int32_t type = tensor_meta(h, tensor, ne, nb);
    if (type != 0 || ne[0] != h->route_n_expert || nb[0] != 4 || nb[1] != 4 * (size_t) ne[0] ||
        ne[2] != 1 || ne[3] != 1) {
        char msg[128];
        snprintf(msg, sizeof msg, "route trace: layer %d's router logits are not (%d, rows) "
                 "f32", layer, h->route_n_expert);
        route_fail(h, msg);
        return false;
    }
    const int32_t rows = (int32_t) ne[1];
    frame_node(&h->route_frame, 2 * layer + biased, rows);   /* graph order in a ubatch */
    if (rows == 0) return true;
    const int64_t n = (int64_t) rows * ne[0];
    if (array_grow((void **) &h->route_row, &h->cap_route_row, n, sizeof(float))) {
        route_fail(h, "route trace: out of memory");
        return false;
    }
    const int64_t first = h->route_start + frame_first(&h->route_frame, rows);
    for (int32_t r = 0; r < rows; r++) {
        const int64_t pos = first + r;
        if (pos < 0 || pos >= h->route_n_pos) {
            char msg[128];
            snprintf(msg, sizeof msg, "route trace: position %lld is past the trace's %lld "
                     "tokens", (long long) pos, (long long) h->route_n_pos);
            route_fail(h, msg);
            return false;
        }
        float *row = h->route_row + (int64_t) r * ne[0];
        for (int64_t e = 0; e < ne[0]; e++) row[e] = -1.0e4f;
        const size_t at = ((size_t) pos * (size_t) h->n_layer + (size_t) layer) * (size_t) h->k;
        for (int32_t s = 0; s < h->k; s++)
            row[h->route_experts[at + s]] = h->route_logits[at + s];
    }
    h->tensor_set(tensor, h->route_row, 0, (size_t) n * sizeof(float));
    return true;
}

bool rh_eval(void *tensor, bool ask, void *user_data) {
    rh_hook *h = (rh_hook *) user_data;
    if (h->route_n_pos > 0 && !h->route_error) {
        int biased = 0;
        const int32_t layer = logits_layer(h, (const char *) tensor + h->name_off, &biased);
        if (layer >= 0)                  /* ask: compute up to here; data: go on, or stop */
            return ask || impose(h, tensor, layer, biased);
    }
    if (h->mode == RH_ROUTE_ONLY) return false;
    return eval_native(h, tensor, ask);
}
