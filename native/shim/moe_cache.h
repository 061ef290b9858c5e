// moe_cache: a persistent per-expert slot cache for MoE layers of a llama.cpp model.
//
// The cache owns, per group of MoE layers with the same expert layout (a "pool"), one slot
// tensor per expert projection ({ne0, ne1, n_slots}) in the buffer of one ggml device
// ("CPU" places them in host memory, "CUDA0" in GPU memory), and per MoE layer an expert -> slot
// table (-1 = not resident). The patched libllama (native/patches) computes resident experts
// from the slots and the others from the model's own tensors; outputs equal the unpatched
// build. Which expert lives where is decided by the caller (moe-offload's residency manager):
// this library only moves bytes and keeps the tables.
//
// Per MoE layer and evaluation, the graph reads three id planes (which path computes each
// routed (token, expert) pair, llama-moe-cache.h) that moe_cache_route writes from the routed
// ids and the table: call it from the context's eval callback, after the layer's router output
// and before its expert matmuls (moe-offload's routing hook does; moe_cache_eval is a ready
// cb_eval for a context nothing else observes). A cached layer whose planes were not written
// computes wrong outputs: routing every layer of every evaluation is part of the contract.
//
// Rules: write slots (moe_cache_slot_set / moe_cache_slot_load) from any thread, for different
// slots concurrently; change tables (moe_cache_table_set) between graph evaluations or from
// the eval callback before the layer's moe_cache_route, and point a table entry at a slot only
// after its bytes are written. Clear the entry of a slot's old expert before overwriting that
// slot.
//
// Usage:
//
//     moe_cache_t cache;     // ubatches up to 512 tokens use it; cb_eval = moe_cache_eval
//     if (moe_cache_create(model, "CPU", 512u << 20, 512, &cache) != MOE_CACHE_OK) { ... }
//     int32_t pool; size_t expert_bytes;
//     moe_cache_layer_info(cache, 3, &pool, &expert_bytes);        // layer 3's pool, bytes
//     int32_t n_slots;
//     moe_cache_pool_info(cache, pool, &n_slots, NULL);
//     moe_cache_slot_load(cache, 3, 17, 0);        // expert 17's bytes -> slot 0 of the pool
//     moe_cache_table_set(cache, 3, 17, 0);        // layer 3 now computes expert 17 from slot 0
//     llama_decode(ctx, batch);
//     moe_cache_table_set(cache, 3, 17, -1);       // evict (before reusing slot 0)
//     moe_cache_free(cache);                       // before llama_model_free
#pragma once

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

struct llama_model;
struct ggml_tensor;
typedef struct moe_cache * moe_cache_t;

enum moe_cache_status {
    MOE_CACHE_OK          = 0,
    MOE_CACHE_ERR_ARG     = 1,  // a bad argument (layer, expert, slot, projection out of range)
    MOE_CACHE_ERR_DEVICE  = 2,  // no ggml device of that name
    MOE_CACHE_ERR_ALLOC   = 3,  // the device could not allocate the slots
    MOE_CACHE_ERR_MODEL   = 4,  // the model has no MoE layer this cache can serve
    MOE_CACHE_ERR_SOURCE  = 5,  // the model's expert tensors are not in host memory
    MOE_CACHE_ERR_LLAMA   = 6,  // libllama refused the registration (not the patched build?)
};

// projections of an expert, in the order moe_cache_slot_set takes them
enum moe_cache_proj {
    MOE_CACHE_PROJ_UP      = 0,
    MOE_CACHE_PROJ_GATE    = 1,
    MOE_CACHE_PROJ_DOWN    = 2,
    MOE_CACHE_PROJ_GATE_UP = 3,
    MOE_CACHE_PROJ_COUNT   = 4,
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
int moe_cache_create(const struct llama_model * model, const char * device, size_t capacity_bytes,
                     int32_t max_tokens, moe_cache_t * out);
// Unregisters and frees everything. Call before llama_model_free.
void moe_cache_free(moe_cache_t cache);

// number of layers of the model (MoE or not) and of pools
int moe_cache_counts(moe_cache_t cache, int32_t * n_layer_out, int32_t * n_pool_out);
// per layer: its pool (-1: not an MoE layer or no slots) and the bytes of one expert (all
// projections; 0 for a dense layer); either out-pointer may be NULL
int moe_cache_layer_info(moe_cache_t cache, int32_t layer, int32_t * pool_out, size_t * expert_bytes_out);
// per pool: assignable slots (sinks excluded) and bytes of one slot (all projections); either
// out-pointer may be NULL
int moe_cache_pool_info(moe_cache_t cache, int32_t pool, int32_t * n_slots_out, size_t * slot_bytes_out);
// bytes of one projection of one expert in a layer (0 when the model has no such projection)
int moe_cache_proj_bytes(moe_cache_t cache, int32_t layer, int32_t proj, size_t * bytes_out);
// total bytes allocated for slots
int moe_cache_allocated_bytes(moe_cache_t cache, size_t * bytes_out);

// Writes one projection of an expert into `slot` of `layer`'s pool from caller memory
// (e.g. a read-only mmap of the GGUF file); `nbytes` must equal moe_cache_proj_bytes.
int moe_cache_slot_set(moe_cache_t cache, int32_t layer, int32_t slot, int32_t proj,
                       const void * src, size_t nbytes);
// Writes every projection of `expert` into `slot`, read from the model's own tensors (which
// must be in host memory, e.g. the mmap'd file).
int moe_cache_slot_load(moe_cache_t cache, int32_t layer, int32_t expert, int32_t slot);
// Reads one projection of a slot back (for tests).
int moe_cache_slot_get(moe_cache_t cache, int32_t layer, int32_t slot, int32_t proj,
                       void * dst, size_t nbytes);

// table: expert -> slot (-1: not resident). Between graph evaluations only.
int moe_cache_table_set(moe_cache_t cache, int32_t layer, int32_t expert, int32_t slot);
int moe_cache_table_get(moe_cache_t cache, int32_t layer, int32_t expert, int32_t * slot_out);

// The id planes of `layer` for this evaluation, from `ids` ([n_tokens][n_expert_used], the
// layer's routed experts) and the table as it is now. Both paths keep the routing positions.
// Where ggml-cpu computes the batch (n_tokens < GGML_OP_OFFLOAD_MIN_BATCH, 32), each path
// computes only its own rows: the cold path's other positions (expert tensors in a plain host
// buffer) and the slot path's misses (slots in host memory) are -1, which the patched ggml-cpu
// skips; otherwise cold positions of resident experts hold distinct fillers (other tokens'
// misses first: the scheduler copies no extra expert for them) and slot misses go to sink
// slots. A layer without slots, or n_tokens > max_tokens, needs nothing (OK).
int moe_cache_route(moe_cache_t cache, int32_t layer, const int32_t * ids, int32_t n_tokens);

// A complete cb_eval (user data: the cache) for a context nobody else observes: remembers each
// cached layer's "ffn_moe_topk-<il>", stops at the layer's first id-plane view (after its final
// router weights, so a backend's fused top-k + weights kernel stays whole) and calls
// moe_cache_route there; returns false (stops the graph) when a route is refused.
bool moe_cache_eval(struct ggml_tensor * t, bool ask, void * user_data);

#ifdef __cplusplus
}
#endif
