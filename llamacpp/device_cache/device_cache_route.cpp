// device cache store: per MoE layer and evaluation, the id planes the patched graph reads
// (llama-moe-cache.h), written from the routed ids and the table (dc_store_route), and a
// cb_eval that calls it at the right node (dc_store_eval).
#include "device_cache_store_impl.h"

#include <algorithm>
#include <climits>
#include <cstdio>
#include <cstring>

int dc_store_route(dc_store_t c, int32_t layer, const int32_t * ids, int32_t n_tokens) {
    if (c == nullptr || layer < 0 || layer >= (int32_t) c->layers.size() || n_tokens < 0 ||
        (ids == nullptr && n_tokens > 0)) {
        return DC_STORE_ERR_ARG;
    }
    const dc_layer & l = c->layers[layer];
    if (!l.registered || n_tokens == 0 || n_tokens > c->max_tokens) {
        return DC_STORE_OK;   // the graph computes this layer without the cache
    }
    const int32_t k = c->n_sink;
    const int64_t n = (int64_t) n_tokens * k;
    for (int64_t i = 0; i < n; ++i) {
        if (ids[i] < 0 || ids[i] >= l.n_expert) {
            return DC_STORE_ERR_ARG;
        }
    }
    const int32_t n_slots = c->pools[l.pool].n_slots;
    std::lock_guard<std::mutex> lock(c->table_mutex);
    c->planes.resize((size_t) (3 * n));
    int32_t * hot = c->planes.data();
    int32_t * pick = hot + n;
    int32_t * cold = pick + n;
    if ((int64_t) c->seen.size() < l.n_expert) {
        c->seen.assign(l.n_expert, 0);
        c->mark.assign(l.n_expert, 0);
        c->seen_gen = c->mark_gen = 0;
    }
    if (c->seen_gen == INT32_MAX || c->mark_gen > INT32_MAX - n_tokens) {
        std::fill(c->seen.begin(), c->seen.end(), 0);
        std::fill(c->mark.begin(), c->mark.end(), 0);
        c->seen_gen = c->mark_gen = 0;
    }
    // ggml-cpu's generic MUL_MAT_ID computes the batch (not offloaded): no row for id -1
    const bool cpu_batch = n_tokens < c->min_batch;
    const bool skip_cold = l.host_plain && cpu_batch;
    const bool skip_hot = c->slots_plain && cpu_batch;
    if (!skip_cold) {
        // the batch's non-resident experts, in order of first use: fillers at no extra bytes
        const int32_t gen = ++c->seen_gen;
        c->misses.clear();
        for (int64_t i = 0; i < n; ++i) {
            const int32_t e = ids[i];
            if (l.table[e] < 0 && c->seen[e] != gen) {
                c->seen[e] = gen;
                c->misses.push_back(e);
            }
        }
    }
    for (int32_t t = 0; t < n_tokens; ++t) {
        const int32_t * sel = ids + (int64_t) t * k;
        int32_t * h = hot + (int64_t) t * k;
        int32_t * pk = pick + (int64_t) t * k;
        int32_t * cd = cold + (int64_t) t * k;
        int32_t m = 0;
        for (int32_t i = 0; i < k; ++i) {
            const int32_t slot = l.table[sel[i]];
            if (slot >= 0) {
                h[i] = slot;
                pk[i] = k + i;
                cd[i] = -1;                        // a filler below, unless rows can be skipped
            } else {
                h[i] = skip_hot ? -1 : n_slots + i;
                pk[i] = i;
                cd[i] = sel[i];
                m++;
            }
        }
        if (m == k || skip_cold) {
            continue;
        }
        // distinct ids at the resident experts' positions: other tokens' misses, then other
        // non-resident experts, then any expert the token does not route to
        const int32_t tg = ++c->mark_gen;
        for (int32_t i = 0; i < k; ++i) {
            c->mark[sel[i]] = tg;
        }
        int32_t u = 0;
        int32_t e_scan = 0;
        int32_t pass = 0;
        for (int32_t i = 0; i < k; ++i) {
            if (cd[i] >= 0) {
                continue;
            }
            int32_t f = -1;
            while (f < 0 && u < (int32_t) c->misses.size()) {
                const int32_t e = c->misses[u++];
                if (c->mark[e] != tg) {
                    f = e;
                }
            }
            while (f < 0 && pass < 2) {
                if (e_scan >= l.n_expert) {
                    e_scan = 0;
                    pass++;
                    continue;
                }
                const int32_t e = e_scan++;
                if (c->mark[e] != tg && (pass == 1 || l.table[e] < 0)) {
                    f = e;
                }
            }
            if (f < 0) {
                f = sel[i];   // fewer experts than 2 k: the resident expert itself (distinct)
            }
            c->mark[f] = tg;
            cd[i] = f;
        }
    }
    ggml_backend_tensor_set(l.remap, c->planes.data(), 0, (size_t) (3 * n) * sizeof(int32_t));
    return DC_STORE_OK;
}

// "<prefix><il>" with nothing after the layer number: the layer, else -1
static int layer_of(const char * name, const char * prefix) {
    const size_t n = strlen(prefix);
    if (strncmp(name, prefix, n) != 0) {
        return -1;
    }
    int layer = -1;
    int used = 0;
    if (sscanf(name + n, "%d%n", &layer, &used) != 1 || name[n + used] != '\0') {
        return -1;
    }
    return layer;
}

bool dc_store_eval(struct ggml_tensor * t, bool ask, void * user_data) {
    auto * c = (dc_store *) user_data;
    if (c == nullptr || strncmp(t->name, "ffn_moe_", 8) != 0) {
        return false;
    }
    const int32_t n_layer = (int32_t) c->layers.size();
    // the router output: remembered (it stays live: the expert matmuls read it), not a stop
    const int topk = layer_of(t->name, "ffn_moe_topk-");
    if (topk >= 0) {
        if (ask && topk < n_layer) {
            c->eval_topk.resize(c->layers.size(), nullptr);
            c->eval_topk[topk] = t;
        }
        return false;
    }
    // the view of a layer's id planes: after the final router weights (a dependency), so a
    // backend's fused top-k + weights kernel stays whole; the planes are written here
    const int layer = layer_of(t->name, "ffn_moe_planes-");
    if (layer < 0 || layer >= n_layer || !c->layers[layer].registered ||
        (int32_t) c->eval_topk.size() <= layer || c->eval_topk[layer] == nullptr) {
        return false;
    }
    if (ask) {
        return true;
    }
    const ggml_tensor * ids_t = c->eval_topk[layer];
    c->eval_topk[layer] = nullptr;          // routed
    if (ids_t->type != GGML_TYPE_I32 || ids_t->ne[0] != c->n_sink || ids_t->ne[2] != 1 || ids_t->ne[3] != 1) {
        return false;   // stops the graph: not the router output this cache knows
    }
    const int64_t n_tokens = ids_t->ne[1];
    std::vector<int32_t> span(ggml_nbytes(ids_t) / sizeof(int32_t) + 1);
    ggml_backend_tensor_get(ids_t, span.data(), 0, ggml_nbytes(ids_t));
    std::vector<int32_t> ids((size_t) (n_tokens * c->n_sink));
    for (int64_t r = 0; r < n_tokens; ++r) {
        for (int32_t i = 0; i < c->n_sink; ++i) {
            ids[(size_t) (r * c->n_sink + i)] = span[(size_t) ((r * ids_t->nb[1] + i * ids_t->nb[0]) / sizeof(int32_t))];
        }
    }
    return dc_store_route(c, layer, ids.data(), (int32_t) n_tokens) == DC_STORE_OK;
}