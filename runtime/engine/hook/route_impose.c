/* route_hook's imposed routing (rh_set_route): at each ffn_moe_logits(_biased)-L node the
 * router's logits are set so that llama.cpp's own top-k selects a trace's experts, with its
 * weights. */
#include "route_hook_impl.h"
#include "../../csupport/grow.h"

#include <stdio.h>
#include <stdlib.h>

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


int rh_impose_node(rh_hook *h, void *tensor, bool ask) {
    int biased = 0;
    const int32_t layer = logits_layer(h, (const char *) tensor + h->name_off, &biased);
    if (layer < 0) return -1;
    return ask || impose(h, tensor, layer, biased);  /* ask: compute up to here; data: go on */
}
