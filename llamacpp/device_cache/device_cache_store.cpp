// device cache store: the device cache's slots and tables in llama.cpp (see device_cache_store.h):
// creating and freeing a store, and what it holds (its layers, pools and bytes).
#include "device_cache_store_impl.h"

#include "llama.h"
#include "llama-moe-cache.h"

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <climits>
#include <map>

namespace {

const char * const k_proj_names[DC_STORE_PROJ_COUNT] = {
    "ffn_up_exps", "ffn_gate_exps", "ffn_down_exps", "ffn_gate_up_exps",
};

} // namespace

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
        dc_layer & l = c->layers[il];
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
        const dc_layer & l0 = c->layers[p.layers[0]];
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
            dc_layer & l = c->layers[il];
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
    const dc_layer & l = c->layers[layer];
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

