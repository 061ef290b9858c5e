/* route_hook: see route_hook.h. The only live framing of routing events; its slow reference
 * is reference.py (RoutingHook._on_eval and RouteAssembler), which it follows
 * rule for rule; tests run both on the same model
 * and compare the events and the managers' counters. */
#include "route_hook_impl.h"
#include "../../native/device_cache.h"
#include "../../ramtier/tier_io.h"
#include "../../residency/core/residency_core.h"
#include "../../csupport/grow.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

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

/* every consumer ends its batch; an error one reports only now (a RAM tier's read that the
 * matmul waited for) fails the batch */
static void end_consumers(rh_hook *h) {
    for (int32_t i = 0; i < h->n_consumers; i++) {
        consumer *u = &h->consumers[i];
        const int rc = u->kind->batch_end(u);
        if (rc != 0) {
            char msg[256];
            u->kind->error(u, -1, rc, msg, sizeof msg);
            fail(h, msg);
        }
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

bool rh_eval(void *tensor, bool ask, void *user_data) {
    rh_hook *h = (rh_hook *) user_data;
    if (h->route_n_pos > 0 && !h->route_error) {
        const int imposed = rh_impose_node(h, tensor, ask);
        if (imposed >= 0) return imposed;
    }
    if (h->mode == RH_ROUTE_ONLY) return false;
    return eval_native(h, tensor, ask);
}
