// device cache store, private: the store's state, shared by its files (internal to
// libmoe_device_cache.so; the API is device_cache_store.h):
//   device_cache_store.cpp  create, free, and what the store holds (layers, pools, bytes)
//   device_cache_slots.cpp  the slots' bytes and the expert -> slot tables
//   device_cache_route.cpp  per evaluation, the id planes from the routed ids (route, eval)
#pragma once

#include "device_cache_store.h"

#include "ggml.h"
#include "ggml-backend.h"

#include <mutex>
#include <tuple>
#include <utility>
#include <vector>

struct dc_layer {
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

struct dc_pool {
    // the layout shared by the pool's layers: (type, ne0, ne1) per projection
    std::vector<std::tuple<int, int64_t, int64_t>> signature;
    std::vector<int32_t> layers;
    size_t slot_bytes = 0;
    int32_t n_slots = 0;
    ggml_tensor * slots[DC_STORE_PROJ_COUNT] = {};
    std::vector<std::pair<int32_t, int32_t>> owner;  // slot -> (layer, expert), (-1, -1) = free
};

struct dc_store {
    std::vector<dc_layer> layers;
    std::vector<dc_pool> pools;
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
