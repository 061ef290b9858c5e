// device cache store (dc_store_*): the device cache's storage inside llama.cpp, persistent
// per-expert slots for MoE layers of a llama.cpp model (libmoe_device_cache.so). It is
// built against the patched llama.cpp API (llama_moe_cache_*, native/patches/0001); the
// device cache's mechanism that fills it (runtime/native/device_cache.c) and its Python side
// (runtime/native/device_cache.py, device_cache_store.py) drive it.
//
// The store owns, per group of MoE layers with the same expert layout (a "pool"), one slot
// tensor per expert projection ({ne0, ne1, n_slots}) in the buffer of one ggml device
// ("CPU" places them in host memory, "CUDA0" in GPU memory), and per MoE layer an expert -> slot
// table (-1 = not resident). The patched libllama (native/patches) computes resident experts
// from the slots and the others from the model's own tensors; outputs equal the unpatched
// build. Which expert lives where is decided by the caller (moe-offload's residency manager):
// this library only moves bytes and keeps the tables.
//
// Per MoE layer and evaluation, the graph reads three id planes (which path computes each
// routed (token, expert) pair, llama-moe-cache.h) that dc_store_route writes from the routed
// ids and the table: call it from the context's eval callback, after the layer's router output
// and before its expert matmuls (moe-offload's routing hook does; dc_store_eval is a ready
// cb_eval for a context nothing else observes). A cached layer whose planes were not written
// computes wrong outputs: routing every layer of every evaluation is part of the contract.
//
// Rules: write slots (dc_store_slot_set / dc_store_slot_load) from any thread, for different
// slots concurrently; change tables (dc_store_table_set) between graph evaluations or from
// the eval callback before the layer's dc_store_route, and point a table entry at a slot only
// after its bytes are written. Clear the entry of a slot's old expert before overwriting that
// slot.
//
// Usage:
//
//     dc_store_t store;     // ubatches up to 512 tokens use it; cb_eval = dc_store_eval
//     if (dc_store_create(model, "CPU", 512u << 20, 512, &store) != DC_STORE_OK) { ... }
//     int32_t pool; size_t expert_bytes;
//     dc_store_layer_info(store, 3, &pool, &expert_bytes);   // layer 3's pool, bytes
//     int32_t n_slots;
//     dc_store_pool_info(store, pool, &n_slots, NULL);
//     dc_store_slot_load(store, 3, 17, 0);      // expert 17's bytes -> slot 0 of the pool
//     dc_store_table_set(store, 3, 17, 0);      // layer 3 now computes expert 17 from slot 0
//     llama_decode(ctx, batch);
//     dc_store_table_set(store, 3, 17, -1);     // evict (before reusing slot 0)
//     dc_store_free(store);                     // before llama_model_free
#pragma once

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

struct llama_model;
struct ggml_tensor;
typedef struct dc_store * dc_store_t;

enum dc_store_status {
    DC_STORE_OK          = 0,
    DC_STORE_ERR_ARG     = 1,  // a bad argument (layer, expert, slot, projection out of range)
    DC_STORE_ERR_DEVICE  = 2,  // no ggml device of that name
    DC_STORE_ERR_ALLOC   = 3,  // the device could not allocate the slots
    DC_STORE_ERR_MODEL   = 4,  // the model has no MoE layer this store can serve
    DC_STORE_ERR_SOURCE  = 5,  // the model's expert tensors are not in host memory
    DC_STORE_ERR_LLAMA   = 6,  // libllama refused the registration (not the patched build?)
};

// projections of an expert, in the order dc_store_slot_set takes them
enum dc_store_proj {
    DC_STORE_PROJ_UP      = 0,
    DC_STORE_PROJ_GATE    = 1,
    DC_STORE_PROJ_DOWN    = 2,
    DC_STORE_PROJ_GATE_UP = 3,
    DC_STORE_PROJ_COUNT   = 4,
};

// Allocates slots for `capacity_bytes` of experts on `device` (a ggml device name: "CPU",
// "CUDA0", "Vulkan0"), split over the pools in proportion to their expert bytes, never more
// slots than a pool has experts, and registers every MoE layer with libllama. Each pool also
// holds n_expert_used "sink" slots (inside the capacity, never assigned: they take the slot
// path's work for non-resident experts, whose outputs are never used). A capacity below
// n_expert_used + 1 experts is valid and gives no slots (every expert computed as usual).
// Ubatches of up to `max_tokens` tokens (the context's n_ubatch) use the cache; each MoE layer
// also holds its id planes, 12 * n_expert_used * max_tokens bytes on the device, outside the
// capacity.
int dc_store_create(const struct llama_model * model, const char * device, size_t capacity_bytes,
                    int32_t max_tokens, dc_store_t * out);
// Unregisters and frees everything. Call before llama_model_free.
void dc_store_free(dc_store_t store);

// number of layers of the model (MoE or not) and of pools
int dc_store_counts(dc_store_t store, int32_t * n_layer_out, int32_t * n_pool_out);
// per layer: its pool (-1: not an MoE layer or no slots) and the bytes of one expert (all
// projections; 0 for a dense layer); either out-pointer may be NULL
int dc_store_layer_info(dc_store_t store, int32_t layer, int32_t * pool_out, size_t * expert_bytes_out);
// per pool: assignable slots (sinks excluded) and bytes of one slot (all projections); either
// out-pointer may be NULL
int dc_store_pool_info(dc_store_t store, int32_t pool, int32_t * n_slots_out, size_t * slot_bytes_out);
// bytes of one projection of one expert in a layer (0 when the model has no such projection)
int dc_store_proj_bytes(dc_store_t store, int32_t layer, int32_t proj, size_t * bytes_out);
// total bytes allocated for slots
int dc_store_allocated_bytes(dc_store_t store, size_t * bytes_out);

// Writes one projection of an expert into `slot` of `layer`'s pool from caller memory
// (e.g. a read-only mmap of the GGUF file); `nbytes` must equal dc_store_proj_bytes.
int dc_store_slot_set(dc_store_t store, int32_t layer, int32_t slot, int32_t proj,
                      const void * src, size_t nbytes);
// Writes every projection of `expert` into `slot`, read from the model's own tensors (which
// must be in host memory, e.g. the mmap'd file).
int dc_store_slot_load(dc_store_t store, int32_t layer, int32_t expert, int32_t slot);
// Reads one projection of a slot back (for tests).
int dc_store_slot_get(dc_store_t store, int32_t layer, int32_t slot, int32_t proj,
                      void * dst, size_t nbytes);

// table: expert -> slot (-1: not resident). Between graph evaluations only.
int dc_store_table_set(dc_store_t store, int32_t layer, int32_t expert, int32_t slot);
int dc_store_table_get(dc_store_t store, int32_t layer, int32_t expert, int32_t * slot_out);

// The id planes of `layer` for this evaluation, from `ids` ([n_tokens][n_expert_used], the
// layer's routed experts) and the table as it is now. Both paths keep the routing positions.
// Where ggml-cpu computes the batch (n_tokens < GGML_OP_OFFLOAD_MIN_BATCH, 32), each path
// computes only its own rows: the cold path's other positions (expert tensors in a plain host
// buffer) and the slot path's misses (slots in host memory) are -1, which the patched ggml-cpu
// skips; otherwise cold positions of resident experts hold distinct fillers (other tokens'
// misses first: the scheduler copies no extra expert for them) and slot misses go to sink
// slots. A layer without slots, or n_tokens > max_tokens, needs nothing (OK).
int dc_store_route(dc_store_t store, int32_t layer, const int32_t * ids, int32_t n_tokens);

// A complete cb_eval (user data: the store) for a context nobody else observes: remembers each
// cached layer's "ffn_moe_topk-<il>", stops at the layer's first id-plane view (after its final
// router weights, so a backend's fused top-k + weights kernel stays whole) and calls
// dc_store_route there; returns false (stops the graph) when a route is refused.
bool dc_store_eval(struct ggml_tensor * t, bool ask, void * user_data);

#ifdef __cplusplus
}
#endif
