// device cache store: the device cache's slots and tables in llama.cpp (see device_cache_store.h).
#include "device_cache_store.h"

#include "ggml.h"
#include "ggml-backend.h"
#include "llama.h"
#include "llama-moe-cache.h"

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <algorithm>
#include <climits>
#include <map>
#include <mutex>
#include <string>
#include <tuple>
#include <vector>

namespace {

const char * const k_proj_names[DC_STORE_PROJ_COUNT] = {
    "ffn_up_exps", "ffn_gate_exps", "ffn_down_exps", "ffn_gate_up_exps",
};

struct layer_state {
    ggml_tensor * exps[DC_STORE_PROJ_COUNT] = {};  // the model's tensors {ne0, ne1, n_expert}
    int32_t pool = -1;
    size_t expert_bytes = 0;                        // all projections of one expert
    int64_t n_expert = 0;
    ggml_tensor * remap = nullptr;                  // I32 {3 * n_used * max_tokens}: the id planes
    std::vector<int32_t> table;                     // expert -> slot, -1 = not resident
    bool host_plain = false;                        // experts in a plain host buffer: the cold
                                                    // path may skip rows (-1, ggml-cpu's generic
                                                    // MUL_MAT_ID) for batches not offloaded
    bool registered = false;
};

struct pool_state {
    // the layout shared by the pool's layers: (type, ne0, ne1) per projection
    std::vector<std::tuple<int, int64_t, int64_t>> signature;
    std::vector<int32_t> layers;
    size_t slot_bytes = 0;
    int32_t n_slots = 0;
    ggml_tensor * slots[DC_STORE_PROJ_COUNT] = {};
    std::vector<std::pair<int32_t, int32_t>> owner;  // slot -> (layer, expert), (-1, -1) = free
};

} // namespace

struct dc_store {
    std::vector<layer_state> layers;
    std::vector<pool_state> pools;
    ggml_context * ctx = nullptr;
    ggml_backend_buffer_t buffer = nullptr;
    std::mutex table_mutex;
    int32_t n_sink = 0;   // sink slots per pool (the model's n_expert_used)
    int32_t max_tokens = 0;
    int32_t min_batch = 32;  // GGML_OP_OFFLOAD_MIN_BATCH: larger batches may run on a GPU
    bool slots_plain = false;  // slots in a plain host buffer: ggml-cpu computes the hot path
    // dc_store_route's scratch (under table_mutex)
    std::vector<int32_t> planes, misses, seen, mark;
    int32_t seen_gen = 0, mark_gen = 0;
    // dc_store_eval: per layer, the router output of the evaluation running (nullptr once routed)
    std::vector<const ggml_tensor *> eval_topk;
};

static bool source_is_host(const ggml_tensor * t) {
    if (t->buffer == nullptr || !ggml_backend_buffer_is_host(t->buffer)) {
        return false;
    }
    // repacked CPU layouts (CPU_REPACK, AMX, KLEIDIAI) are not the file's bytes
    const char * name = ggml_backend_buft_name(ggml_backend_buffer_get_type(t->buffer));
    return strstr(name, "REPACK") == nullptr && strstr(name, "AMX") == nullptr && strstr(name, "KLEIDI") == nullptr;
}

// may the cold path repeat an expert id within a token? Only ggml-cpu's generic MUL_MAT_ID
// handles repeats: the tensor must sit in a plain host buffer (not repacked, not a device; the
// scheduler offloads large batches to a GPU, which dc_store_route checks per batch)
static bool plain_host_buffer(ggml_backend_buffer_t buffer) {
    if (buffer == nullptr || !ggml_backend_buffer_is_host(buffer)) {
        return false;
    }
    const char * name = ggml_backend_buft_name(ggml_backend_buffer_get_type(buffer));
    const size_t len = strlen(name);
    const bool pinned = len > 5 && strcmp(name + len - 5, "_Host") == 0;  // e.g. CUDA_Host
    return strcmp(name, "CPU") == 0 || strcmp(name, "CPU_Mapped") == 0 || pinned;
}

static bool plain_host(const ggml_tensor * t) {
    return plain_host_buffer(t->buffer);
}

static void free_cache(dc_store * c) {
    for (auto & l : c->layers) {
        if (l.registered) {
            llama_moe_cache_register(l.exps[DC_STORE_PROJ_DOWN], nullptr);
        }
    }
    if (c->buffer != nullptr) {
        ggml_backend_buffer_free(c->buffer);
    }
    if (c->ctx != nullptr) {
        ggml_free(c->ctx);
    }
    delete c;
}

int dc_store_create(const llama_model * model, const char * device, size_t capacity_bytes, int32_t max_tokens,
                    dc_store_t * out) {
    if (model == nullptr || device == nullptr || out == nullptr || max_tokens < 1) {
        return DC_STORE_ERR_ARG;
    }
    *out = nullptr;
    ggml_backend_dev_t dev = ggml_backend_dev_by_name(device);
    if (dev == nullptr) {
        return DC_STORE_ERR_DEVICE;
    }
    auto * c = new dc_store();
    c->max_tokens = max_tokens;
    if (const char * env = getenv("GGML_OP_OFFLOAD_MIN_BATCH")) {
        c->min_batch = atoi(env);
    }
    const int32_t n_layer = llama_model_n_layer(model);
    c->layers.resize(n_layer);

    // find the MoE layers and group them into pools by layout
    std::map<std::vector<std::tuple<int, int64_t, int64_t>>, int32_t> pool_of;
    size_t total_expert_bytes = 0;
    for (int32_t il = 0; il < n_layer; ++il) {
        layer_state & l = c->layers[il];
        std::vector<std::tuple<int, int64_t, int64_t>> sig;
        for (int p = 0; p < DC_STORE_PROJ_COUNT; ++p) {
            char name[128];
            snprintf(name, sizeof(name), "blk.%d.%s.weight", il, k_proj_names[p]);
            ggml_tensor * t = llama_moe_cache_model_tensor(model, name);
            l.exps[p] = t;
            sig.emplace_back(t ? (int) t->type : -1, t ? t->ne[0] : 0, t ? t->ne[1] : 0);
            if (t != nullptr) {
                l.expert_bytes += t->nb[2];
            }
        }
        // per-expert biases and scales stay in the model tensors: the patched graph looks them
        // up by expert id on both paths
        ggml_tensor * down = l.exps[DC_STORE_PROJ_DOWN];
        if (down == nullptr || (l.exps[DC_STORE_PROJ_UP] == nullptr && l.exps[DC_STORE_PROJ_GATE_UP] == nullptr)) {
            l.expert_bytes = 0;
            continue;
        }
        l.n_expert = down->ne[2];
        l.table.assign(l.n_expert, -1);
        l.host_plain = true;
        for (const ggml_tensor * t : l.exps) {
            l.host_plain = l.host_plain && (t == nullptr || plain_host(t));
        }
        total_expert_bytes += l.expert_bytes * l.n_expert;
        auto it = pool_of.find(sig);
        if (it == pool_of.end()) {
            it = pool_of.emplace(sig, (int32_t) c->pools.size()).first;
            c->pools.emplace_back();
            c->pools.back().signature = sig;
            c->pools.back().slot_bytes = l.expert_bytes;
        }
        l.pool = it->second;
        c->pools[it->second].layers.push_back(il);
    }
    if (c->pools.empty()) {
        delete c;
        return DC_STORE_ERR_MODEL;
    }

    // sinks per pool: never-assigned slots for the zero-weighted work of non-resident experts
    // (one per routing position, so slot ids stay distinct within a token; see llama-moe-cache.h)
    char arch[64] = {0};
    char key[128];
    char value[32] = {0};
    llama_model_meta_val_str(model, "general.architecture", arch, sizeof(arch));
    snprintf(key, sizeof(key), "%s.expert_used_count", arch);
    const int32_t n_sink = llama_model_meta_val_str(model, key, value, sizeof(value)) > 0 ? atoi(value) : 0;
    if (n_sink <= 0) {
        free_cache(c);
        return DC_STORE_ERR_MODEL;
    }
    c->n_sink = n_sink;
    if ((int64_t) 3 * n_sink * max_tokens > INT32_MAX / 4) {
        free_cache(c);
        return DC_STORE_ERR_ARG;
    }

    // slots per pool: the capacity split in proportion to the pool's expert bytes, sinks included
    size_t n_tensors = 0;
    for (auto & p : c->pools) {
        size_t pool_experts = 0;
        for (int32_t il : p.layers) {
            pool_experts += (size_t) c->layers[il].n_expert;
        }
        const double share = (double) (p.slot_bytes * pool_experts) / (double) total_expert_bytes;
        size_t n = (size_t) ((double) capacity_bytes * share) / p.slot_bytes;
        if (c->pools.size() == 1) {
            n = capacity_bytes / p.slot_bytes;
        }
        n = n > (size_t) n_sink ? n - n_sink : 0;
        p.n_slots = (int32_t) (n < pool_experts ? n : pool_experts);
        p.owner.assign(p.n_slots, {-1, -1});
        n_tensors += DC_STORE_PROJ_COUNT;
    }
    n_tensors += c->layers.size();

    ggml_init_params params = { ggml_tensor_overhead() * (n_tensors + 8), nullptr, true };
    c->ctx = ggml_init(params);
    for (auto & p : c->pools) {
        if (p.n_slots == 0) {
            continue;
        }
        const layer_state & l0 = c->layers[p.layers[0]];
        for (int q = 0; q < DC_STORE_PROJ_COUNT; ++q) {
            const ggml_tensor * e = l0.exps[q];
            if (e != nullptr) {
                p.slots[q] = ggml_new_tensor_3d(c->ctx, e->type, e->ne[0], e->ne[1], p.n_slots + n_sink);
            }
        }
        for (int32_t il : p.layers) {
            c->layers[il].remap = ggml_new_tensor_1d(c->ctx, GGML_TYPE_I32, (int64_t) 3 * n_sink * max_tokens);
        }
    }
    if (ggml_get_first_tensor(c->ctx) != nullptr) {
        c->buffer = ggml_backend_alloc_ctx_tensors_from_buft(c->ctx, ggml_backend_dev_buffer_type(dev));
        if (c->buffer == nullptr) {
            free_cache(c);
            return DC_STORE_ERR_ALLOC;
        }
        c->slots_plain = plain_host_buffer(c->buffer);
        // zeroed: sink slots compute finite values (never used), id planes are valid ids
        ggml_backend_buffer_clear(c->buffer, 0);
        // weights: the scheduler runs the ops that read them on this device (with the dense
        // layers elsewhere, e.g. on a remote or a GPU next to CPU layers, it would otherwise
        // copy every slot to the CPU for each graph)
        ggml_backend_buffer_set_usage(c->buffer, GGML_BACKEND_BUFFER_USAGE_WEIGHTS);
    }
    for (auto & p : c->pools) {
        if (p.n_slots == 0) {
            continue;
        }
        for (int32_t il : p.layers) {
            layer_state & l = c->layers[il];
            llama_moe_cache_layer reg = {
                p.slots[DC_STORE_PROJ_UP], p.slots[DC_STORE_PROJ_GATE], p.slots[DC_STORE_PROJ_GATE_UP],
                p.slots[DC_STORE_PROJ_DOWN], l.remap, p.n_slots, n_sink, max_tokens,
            };
            if (!llama_moe_cache_register(l.exps[DC_STORE_PROJ_DOWN], &reg)) {
                free_cache(c);
                return DC_STORE_ERR_LLAMA;
            }
            l.registered = true;
        }
    }
    *out = c;
    return DC_STORE_OK;
}

void dc_store_free(dc_store_t cache) {
    if (cache != nullptr) {
        free_cache(cache);
    }
}

int dc_store_counts(dc_store_t c, int32_t * n_layer_out, int32_t * n_pool_out) {
    if (c == nullptr) {
        return DC_STORE_ERR_ARG;
    }
    if (n_layer_out) *n_layer_out = (int32_t) c->layers.size();
    if (n_pool_out)  *n_pool_out  = (int32_t) c->pools.size();
    return DC_STORE_OK;
}

int dc_store_layer_info(dc_store_t c, int32_t layer, int32_t * pool_out, size_t * expert_bytes_out) {
    if (c == nullptr || layer < 0 || layer >= (int32_t) c->layers.size()) {
        return DC_STORE_ERR_ARG;
    }
    const layer_state & l = c->layers[layer];
    if (pool_out) *pool_out = (l.pool >= 0 && c->pools[l.pool].n_slots > 0) ? l.pool : -1;
    if (expert_bytes_out) *expert_bytes_out = l.expert_bytes;
    return DC_STORE_OK;
}

int dc_store_pool_info(dc_store_t c, int32_t pool, int32_t * n_slots_out, size_t * slot_bytes_out) {
    if (c == nullptr || pool < 0 || pool >= (int32_t) c->pools.size()) {
        return DC_STORE_ERR_ARG;
    }
    if (n_slots_out)    *n_slots_out    = c->pools[pool].n_slots;
    if (slot_bytes_out) *slot_bytes_out = c->pools[pool].slot_bytes;
    return DC_STORE_OK;
}

int dc_store_proj_bytes(dc_store_t c, int32_t layer, int32_t proj, size_t * bytes_out) {
    if (c == nullptr || layer < 0 || layer >= (int32_t) c->layers.size() || proj < 0 ||
        proj >= DC_STORE_PROJ_COUNT || bytes_out == nullptr) {
        return DC_STORE_ERR_ARG;
    }
    const ggml_tensor * t = c->layers[layer].exps[proj];
    *bytes_out = (t != nullptr && c->layers[layer].pool >= 0) ? t->nb[2] : 0;
    return DC_STORE_OK;
}

int dc_store_allocated_bytes(dc_store_t c, size_t * bytes_out) {
    if (c == nullptr || bytes_out == nullptr) {
        return DC_STORE_ERR_ARG;
    }
    *bytes_out = c->buffer != nullptr ? ggml_backend_buffer_get_size(c->buffer) : 0;
    return DC_STORE_OK;
}

// the slot tensor of (layer, proj) and the byte offset of `slot` in it, or nullptr
static ggml_tensor * slot_tensor(dc_store * c, int32_t layer, int32_t slot, int32_t proj, size_t * offset) {
    if (c == nullptr || layer < 0 || layer >= (int32_t) c->layers.size() || proj < 0 || proj >= DC_STORE_PROJ_COUNT) {
        return nullptr;
    }
    const layer_state & l = c->layers[layer];
    if (l.pool < 0) {
        return nullptr;
    }
    pool_state & p = c->pools[l.pool];
    if (slot < 0 || slot >= p.n_slots || p.slots[proj] == nullptr) {
        return nullptr;
    }
    *offset = (size_t) slot * p.slots[proj]->nb[2];
    return p.slots[proj];
}

int dc_store_slot_set(dc_store_t c, int32_t layer, int32_t slot, int32_t proj, const void * src, size_t nbytes) {
    size_t offset = 0;
    ggml_tensor * t = slot_tensor(c, layer, slot, proj, &offset);
    if (t == nullptr || src == nullptr || nbytes != t->nb[2]) {
        return DC_STORE_ERR_ARG;
    }
    ggml_backend_tensor_set(t, src, offset, nbytes);
    return DC_STORE_OK;
}

int dc_store_slot_get(dc_store_t c, int32_t layer, int32_t slot, int32_t proj, void * dst, size_t nbytes) {
    size_t offset = 0;
    ggml_tensor * t = slot_tensor(c, layer, slot, proj, &offset);
    if (t == nullptr || dst == nullptr || nbytes != t->nb[2]) {
        return DC_STORE_ERR_ARG;
    }
    ggml_backend_tensor_get(t, dst, offset, nbytes);
    return DC_STORE_OK;
}

int dc_store_slot_load(dc_store_t c, int32_t layer, int32_t expert, int32_t slot) {
    if (c == nullptr || layer < 0 || layer >= (int32_t) c->layers.size()) {
        return DC_STORE_ERR_ARG;
    }
    const layer_state & l = c->layers[layer];
    if (expert < 0 || expert >= l.n_expert) {
        return DC_STORE_ERR_ARG;
    }
    for (int q = 0; q < DC_STORE_PROJ_COUNT; ++q) {
        const ggml_tensor * e = l.exps[q];
        if (e != nullptr && !source_is_host(e)) {
            return DC_STORE_ERR_SOURCE;
        }
    }
    for (int q = 0; q < DC_STORE_PROJ_COUNT; ++q) {
        const ggml_tensor * e = l.exps[q];
        if (e == nullptr) {
            continue;
        }
        const char * src = (const char *) e->data + (size_t) expert * e->nb[2];
        const int rc = dc_store_slot_set(c, layer, slot, q, src, e->nb[2]);
        if (rc != DC_STORE_OK) {
            return rc;
        }
    }
    return DC_STORE_OK;
}

int dc_store_table_set(dc_store_t c, int32_t layer, int32_t expert, int32_t slot) {
    if (c == nullptr || layer < 0 || layer >= (int32_t) c->layers.size()) {
        return DC_STORE_ERR_ARG;
    }
    layer_state & l = c->layers[layer];
    if (l.pool < 0 || expert < 0 || expert >= l.n_expert) {
        return DC_STORE_ERR_ARG;
    }
    pool_state & p = c->pools[l.pool];
    if (slot < -1 || slot >= p.n_slots) {
        return DC_STORE_ERR_ARG;
    }
    if (p.n_slots == 0) {
        return DC_STORE_OK;  // no slots: nothing is ever resident
    }
    std::lock_guard<std::mutex> lock(c->table_mutex);
    // invariant: a slot holds at most one (layer, expert) of its pool
    if (slot >= 0 && p.owner[slot].first >= 0 && p.owner[slot] != std::make_pair(layer, expert)) {
        return DC_STORE_ERR_ARG;
    }
    const int32_t old = l.table[expert];
    if (old >= 0) {
        p.owner[old] = {-1, -1};
    }
    l.table[expert] = slot;
    if (slot >= 0) {
        p.owner[slot] = {layer, expert};
    }
    return DC_STORE_OK;
}

int dc_store_table_get(dc_store_t c, int32_t layer, int32_t expert, int32_t * slot_out) {
    if (c == nullptr || layer < 0 || layer >= (int32_t) c->layers.size() || slot_out == nullptr) {
        return DC_STORE_ERR_ARG;
    }
    const layer_state & l = c->layers[layer];
    if (expert < 0 || expert >= l.n_expert) {
        return DC_STORE_ERR_ARG;
    }
    std::lock_guard<std::mutex> lock(c->table_mutex);
    *slot_out = l.table[expert];
    return DC_STORE_OK;
}

int dc_store_route(dc_store_t c, int32_t layer, const int32_t * ids, int32_t n_tokens) {
    if (c == nullptr || layer < 0 || layer >= (int32_t) c->layers.size() || n_tokens < 0 ||
        (ids == nullptr && n_tokens > 0)) {
        return DC_STORE_ERR_ARG;
    }
    const layer_state & l = c->layers[layer];
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
