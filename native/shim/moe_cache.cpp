// moe_cache: persistent per-expert slot cache (see moe_cache.h for the API and its rules).
#include "moe_cache.h"

#include "ggml.h"
#include "ggml-backend.h"
#include "llama.h"
#include "llama-moe-cache.h"

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <string>
#include <tuple>
#include <vector>

namespace {

const char * const k_proj_names[MOE_CACHE_PROJ_COUNT] = {
    "ffn_up_exps", "ffn_gate_exps", "ffn_down_exps", "ffn_gate_up_exps",
};

struct layer_state {
    ggml_tensor * exps[MOE_CACHE_PROJ_COUNT] = {};  // the model's tensors {ne0, ne1, n_expert}
    int32_t pool = -1;
    size_t expert_bytes = 0;                        // all projections of one expert
    int64_t n_expert = 0;
    ggml_tensor * ids  = nullptr;                   // I32 {1, n_expert}
    ggml_tensor * mask = nullptr;                   // F32 {1, n_expert}
    std::vector<int32_t> table;                     // expert -> slot, -1 = not resident
    bool registered = false;
};

struct pool_state {
    // the layout shared by the pool's layers: (type, ne0, ne1) per projection
    std::vector<std::tuple<int, int64_t, int64_t>> signature;
    std::vector<int32_t> layers;
    size_t slot_bytes = 0;
    int32_t n_slots = 0;
    ggml_tensor * slots[MOE_CACHE_PROJ_COUNT] = {};
    std::vector<std::pair<int32_t, int32_t>> owner;  // slot -> (layer, expert), (-1, -1) = free
};

} // namespace

struct moe_cache {
    std::vector<layer_state> layers;
    std::vector<pool_state> pools;
    ggml_context * ctx = nullptr;
    ggml_backend_buffer_t buffer = nullptr;
    std::mutex table_mutex;
    int32_t n_sink = 0;   // sink slots per pool (the model's n_expert_used)
};

static bool source_is_host(const ggml_tensor * t) {
    if (t->buffer == nullptr || !ggml_backend_buffer_is_host(t->buffer)) {
        return false;
    }
    // repacked CPU layouts (CPU_REPACK, AMX, KLEIDIAI) are not the file's bytes
    const char * name = ggml_backend_buft_name(ggml_backend_buffer_get_type(t->buffer));
    return strstr(name, "REPACK") == nullptr && strstr(name, "AMX") == nullptr && strstr(name, "KLEIDI") == nullptr;
}

static void free_cache(moe_cache * c) {
    for (auto & l : c->layers) {
        if (l.registered) {
            llama_moe_cache_register(l.exps[MOE_CACHE_PROJ_DOWN], nullptr);
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

int moe_cache_create(const llama_model * model, const char * device, size_t capacity_bytes, moe_cache_t * out) {
    if (model == nullptr || device == nullptr || out == nullptr) {
        return MOE_CACHE_ERR_ARG;
    }
    *out = nullptr;
    ggml_backend_dev_t dev = ggml_backend_dev_by_name(device);
    if (dev == nullptr) {
        return MOE_CACHE_ERR_DEVICE;
    }
    auto * c = new moe_cache();
    const int32_t n_layer = llama_model_n_layer(model);
    c->layers.resize(n_layer);

    // find the MoE layers and group them into pools by layout
    std::map<std::vector<std::tuple<int, int64_t, int64_t>>, int32_t> pool_of;
    size_t total_expert_bytes = 0;
    for (int32_t il = 0; il < n_layer; ++il) {
        layer_state & l = c->layers[il];
        std::vector<std::tuple<int, int64_t, int64_t>> sig;
        for (int p = 0; p < MOE_CACHE_PROJ_COUNT; ++p) {
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
        ggml_tensor * down = l.exps[MOE_CACHE_PROJ_DOWN];
        if (down == nullptr || (l.exps[MOE_CACHE_PROJ_UP] == nullptr && l.exps[MOE_CACHE_PROJ_GATE_UP] == nullptr)) {
            l.expert_bytes = 0;
            continue;
        }
        l.n_expert = down->ne[2];
        l.table.assign(l.n_expert, -1);
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
        return MOE_CACHE_ERR_MODEL;
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
        return MOE_CACHE_ERR_MODEL;
    }
    c->n_sink = n_sink;

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
        n_tensors += MOE_CACHE_PROJ_COUNT;
    }
    n_tensors += 2 * c->layers.size();

    ggml_init_params params = { ggml_tensor_overhead() * (n_tensors + 8), nullptr, true };
    c->ctx = ggml_init(params);
    for (auto & p : c->pools) {
        if (p.n_slots == 0) {
            continue;
        }
        const layer_state & l0 = c->layers[p.layers[0]];
        for (int q = 0; q < MOE_CACHE_PROJ_COUNT; ++q) {
            const ggml_tensor * e = l0.exps[q];
            if (e != nullptr) {
                p.slots[q] = ggml_new_tensor_3d(c->ctx, e->type, e->ne[0], e->ne[1], p.n_slots + n_sink);
            }
        }
        for (int32_t il : p.layers) {
            layer_state & l = c->layers[il];
            l.ids  = ggml_new_tensor_2d(c->ctx, GGML_TYPE_F32, 1, l.n_expert);
            l.mask = ggml_new_tensor_2d(c->ctx, GGML_TYPE_F32, 1, l.n_expert);
        }
    }
    if (ggml_get_first_tensor(c->ctx) != nullptr) {
        c->buffer = ggml_backend_alloc_ctx_tensors_from_buft(c->ctx, ggml_backend_dev_buffer_type(dev));
        if (c->buffer == nullptr) {
            free_cache(c);
            return MOE_CACHE_ERR_ALLOC;
        }
        // zeroed slots compute to finite values (0) even for entries pointing at an empty slot
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
                p.slots[MOE_CACHE_PROJ_UP], p.slots[MOE_CACHE_PROJ_GATE], p.slots[MOE_CACHE_PROJ_GATE_UP],
                p.slots[MOE_CACHE_PROJ_DOWN], l.ids, l.mask, p.n_slots,
            };
            if (!llama_moe_cache_register(l.exps[MOE_CACHE_PROJ_DOWN], &reg)) {
                free_cache(c);
                return MOE_CACHE_ERR_LLAMA;
            }
            l.registered = true;
        }
    }
    *out = c;
    return MOE_CACHE_OK;
}

void moe_cache_free(moe_cache_t cache) {
    if (cache != nullptr) {
        free_cache(cache);
    }
}

int moe_cache_counts(moe_cache_t c, int32_t * n_layer_out, int32_t * n_pool_out) {
    if (c == nullptr) {
        return MOE_CACHE_ERR_ARG;
    }
    if (n_layer_out) *n_layer_out = (int32_t) c->layers.size();
    if (n_pool_out)  *n_pool_out  = (int32_t) c->pools.size();
    return MOE_CACHE_OK;
}

int moe_cache_layer_info(moe_cache_t c, int32_t layer, int32_t * pool_out, size_t * expert_bytes_out) {
    if (c == nullptr || layer < 0 || layer >= (int32_t) c->layers.size()) {
        return MOE_CACHE_ERR_ARG;
    }
    const layer_state & l = c->layers[layer];
    if (pool_out) *pool_out = (l.pool >= 0 && c->pools[l.pool].n_slots > 0) ? l.pool : -1;
    if (expert_bytes_out) *expert_bytes_out = l.expert_bytes;
    return MOE_CACHE_OK;
}

int moe_cache_pool_info(moe_cache_t c, int32_t pool, int32_t * n_slots_out, size_t * slot_bytes_out) {
    if (c == nullptr || pool < 0 || pool >= (int32_t) c->pools.size()) {
        return MOE_CACHE_ERR_ARG;
    }
    if (n_slots_out)    *n_slots_out    = c->pools[pool].n_slots;
    if (slot_bytes_out) *slot_bytes_out = c->pools[pool].slot_bytes;
    return MOE_CACHE_OK;
}

int moe_cache_proj_bytes(moe_cache_t c, int32_t layer, int32_t proj, size_t * bytes_out) {
    if (c == nullptr || layer < 0 || layer >= (int32_t) c->layers.size() || proj < 0 ||
        proj >= MOE_CACHE_PROJ_COUNT || bytes_out == nullptr) {
        return MOE_CACHE_ERR_ARG;
    }
    const ggml_tensor * t = c->layers[layer].exps[proj];
    *bytes_out = (t != nullptr && c->layers[layer].pool >= 0) ? t->nb[2] : 0;
    return MOE_CACHE_OK;
}

int moe_cache_allocated_bytes(moe_cache_t c, size_t * bytes_out) {
    if (c == nullptr || bytes_out == nullptr) {
        return MOE_CACHE_ERR_ARG;
    }
    *bytes_out = c->buffer != nullptr ? ggml_backend_buffer_get_size(c->buffer) : 0;
    return MOE_CACHE_OK;
}

// the slot tensor of (layer, proj) and the byte offset of `slot` in it, or nullptr
static ggml_tensor * slot_tensor(moe_cache * c, int32_t layer, int32_t slot, int32_t proj, size_t * offset) {
    if (c == nullptr || layer < 0 || layer >= (int32_t) c->layers.size() || proj < 0 || proj >= MOE_CACHE_PROJ_COUNT) {
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

int moe_cache_slot_set(moe_cache_t c, int32_t layer, int32_t slot, int32_t proj, const void * src, size_t nbytes) {
    size_t offset = 0;
    ggml_tensor * t = slot_tensor(c, layer, slot, proj, &offset);
    if (t == nullptr || src == nullptr || nbytes != t->nb[2]) {
        return MOE_CACHE_ERR_ARG;
    }
    ggml_backend_tensor_set(t, src, offset, nbytes);
    return MOE_CACHE_OK;
}

int moe_cache_slot_get(moe_cache_t c, int32_t layer, int32_t slot, int32_t proj, void * dst, size_t nbytes) {
    size_t offset = 0;
    ggml_tensor * t = slot_tensor(c, layer, slot, proj, &offset);
    if (t == nullptr || dst == nullptr || nbytes != t->nb[2]) {
        return MOE_CACHE_ERR_ARG;
    }
    ggml_backend_tensor_get(t, dst, offset, nbytes);
    return MOE_CACHE_OK;
}

int moe_cache_slot_load(moe_cache_t c, int32_t layer, int32_t expert, int32_t slot) {
    if (c == nullptr || layer < 0 || layer >= (int32_t) c->layers.size()) {
        return MOE_CACHE_ERR_ARG;
    }
    const layer_state & l = c->layers[layer];
    if (expert < 0 || expert >= l.n_expert) {
        return MOE_CACHE_ERR_ARG;
    }
    for (int q = 0; q < MOE_CACHE_PROJ_COUNT; ++q) {
        const ggml_tensor * e = l.exps[q];
        if (e != nullptr && !source_is_host(e)) {
            return MOE_CACHE_ERR_SOURCE;
        }
    }
    for (int q = 0; q < MOE_CACHE_PROJ_COUNT; ++q) {
        const ggml_tensor * e = l.exps[q];
        if (e == nullptr) {
            continue;
        }
        const char * src = (const char *) e->data + (size_t) expert * e->nb[2];
        const int rc = moe_cache_slot_set(c, layer, slot, q, src, e->nb[2]);
        if (rc != MOE_CACHE_OK) {
            return rc;
        }
    }
    return MOE_CACHE_OK;
}

int moe_cache_table_set(moe_cache_t c, int32_t layer, int32_t expert, int32_t slot) {
    if (c == nullptr || layer < 0 || layer >= (int32_t) c->layers.size()) {
        return MOE_CACHE_ERR_ARG;
    }
    layer_state & l = c->layers[layer];
    if (l.pool < 0 || expert < 0 || expert >= l.n_expert) {
        return MOE_CACHE_ERR_ARG;
    }
    pool_state & p = c->pools[l.pool];
    if (slot < -1 || slot >= p.n_slots) {
        return MOE_CACHE_ERR_ARG;
    }
    if (p.n_slots == 0) {
        return MOE_CACHE_OK;  // no slots: nothing is ever resident
    }
    std::lock_guard<std::mutex> lock(c->table_mutex);
    // invariant: a slot holds at most one (layer, expert) of its pool
    if (slot >= 0 && p.owner[slot].first >= 0 && p.owner[slot] != std::make_pair(layer, expert)) {
        return MOE_CACHE_ERR_ARG;
    }
    const int32_t old = l.table[expert];
    if (old >= 0) {
        p.owner[old] = {-1, -1};
    }
    l.table[expert] = slot;
    if (slot >= 0) {
        p.owner[slot] = {layer, expert};
    }
    const float id = slot >= 0 ? (float) slot : 0.0f;   // exact: slots < 2^24
    const float m  = slot >= 0 ? 1.0f : 0.0f;
    ggml_backend_tensor_set(l.ids,  &id, (size_t) expert * sizeof(float), sizeof(float));
    ggml_backend_tensor_set(l.mask, &m,  (size_t) expert * sizeof(float),   sizeof(float));
    return MOE_CACHE_OK;
}

int moe_cache_table_get(moe_cache_t c, int32_t layer, int32_t expert, int32_t * slot_out) {
    if (c == nullptr || layer < 0 || layer >= (int32_t) c->layers.size() || slot_out == nullptr) {
        return MOE_CACHE_ERR_ARG;
    }
    const layer_state & l = c->layers[layer];
    if (expert < 0 || expert >= l.n_expert) {
        return MOE_CACHE_ERR_ARG;
    }
    std::lock_guard<std::mutex> lock(c->table_mutex);
    *slot_out = l.table[expert];
    return MOE_CACHE_OK;
}
