/* route_hook: llama.cpp's eval callback (cb_eval) in C, built into moe-offload's one C library
 * with the residency core (runtime/clib.py; this part: clib.toml) so that it calls the core,
 * the device cache and the RAM tier directly. The only live
 * framing of routing events (reference.py is its slow reference).
 *
 * Per MoE layer-step the hook reads the router output (ffn_moe_topk, the applied weight
 * stage), frames it into an event (layer, phase, first_step, turn, rows, experts, weights:
 * ubatches, the last layer's trimmed rows) and steps every consumer on its one list before
 * the layer's expert matmuls run; it buffers the event, and Python takes the batch's events
 * once per decode call (rh_copy_events). At the batch's end every consumer ends its batch.
 *
 *   consumer          step (per event)                    batch_end          error
 *   bookkeeping core  rc_step (a lease the core mints)    rc_step_end        rc_step_message
 *   device cache      dc_route (copies, id planes)        dc_batch_end       its status
 *   RAM tier          rt_step (page-ins before the matmul) rt_batch_end      rt_error
 *   observer adapter  Python's synchronous observers      (Python)           "observer failed"
 *
 *     rh_hook *h = rh_create(n_layer, is_moe, n_expert_used, tensor_get, offsets...);
 *     rh_add_consumer(h, RH_CONSUMER_CORE, core);
 *     ... cb_eval = rh_eval, cb_eval_user_data = h ...
 *     rh_begin_batch(h, phase, first_step, n_tokens, n_outputs, turn, strict);
 *     llama_decode(...);
 *     if (rh_end_batch(h) != 0) ... rh_error(h) ...;
 *     rh_copy_events(h, meta, experts, weights);       // the batch's events, once
 *
 * Modes, switched between decode calls: RH_NATIVE (the above), RH_ROUTE_ONLY (imposed routing,
 * rh_set_route, and nothing else).
 */
#ifndef ROUTE_HOOK_H
#define ROUTE_HOOK_H
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

typedef struct rh_hook rh_hook;
typedef bool (*rh_eval_cb)(void *tensor, bool ask, void *user_data);
typedef void (*rh_tensor_get)(const void *tensor, void *data, size_t offset, size_t size);
typedef void (*rh_tensor_set)(void *tensor, const void *data, size_t offset, size_t size);

enum { RH_NATIVE = 1, RH_ROUTE_ONLY = 2 };

rh_hook *rh_create(int32_t n_layer, const uint8_t *is_moe, int32_t n_expert_used,
                   rh_tensor_get tensor_get, size_t type_off, size_t ne_off, size_t nb_off,
                   size_t name_off);
void rh_free(rh_hook *h);
bool rh_eval(void *tensor, bool ask, void *user_data);
void rh_set_mode(rh_hook *h, int32_t mode);

/* watched nodes (tests, diagnostics): the nodes named exactly `names` (at most 16, each
 * "ffn_moe_*", < 64 bytes) go to `cb` (ask, then the data: false stops the graph) */
int rh_set_watch(rh_hook *h, rh_eval_cb cb, void *user_data, const char *const *names,
                 int32_t n);

/* the consumers: one list, stepped with every event in kind order (bookkeeping cores, device
 * caches, RAM tiers, the observer adapter), each before the layer's expert matmuls run, and
 * ended at every batch's end (a failed or aborted one too). At most 24.
 *   RH_CONSUMER_CORE   an rc_core (residency_core.h): rc_step, the decisions only
 *   RH_CONSUMER_CACHE  a dc_cache (device_cache.h): dc_route (copies, id planes), dc_batch_end
 *   RH_CONSUMER_TIER   an rt_tier (tier_io.h): rt_step (page-ins), rt_batch_end
 * 0, or -1 (a full list, an unknown kind, NULL). rh_clear_consumers drops one kind's. */
enum { RH_CONSUMER_CORE = 0, RH_CONSUMER_CACHE = 1, RH_CONSUMER_TIER = 2,
       RH_CONSUMER_OBSERVER = 3 };
int rh_add_consumer(rh_hook *h, int32_t kind, void *obj);
void rh_clear_consumers(rh_hook *h, int32_t kind);
/* the synchronous observers' adapter (the last entry; NULL: none): called with every event,
 * experts / weights (n_rows, n_expert_used) valid during the call only; non-zero fails the
 * batch (the graph stops at the next node) */
typedef int (*rh_event_cb)(int32_t layer, int32_t phase, int64_t first_step, int32_t turn,
                           int32_t n_rows, const int32_t *experts, const float *weights,
                           void *user_data);
void rh_set_observer(rh_hook *h, rh_event_cb cb, void *user_data);

/* imposed routing (--route-trace), either mode: at every MoE layer the router's logits
 * (ffn_moe_logits, then ffn_moe_logits_biased where the router has a bias) are overwritten so
 * that llama.cpp's own top-k selects `experts` for each token position; `logits` holds the
 * values the selected experts get (descending in slot order), all others get -1e4.
 * experts, logits: (n_pos, n_layer, n_expert_used), indexed by context position; rows of a
 * non-MoE layer are ignored. n_pos 0 turns it off (no cost: one pointer test per node).
 * 0, or -1 (bad arguments, an expert id >= n_expert, no memory). Before each decode call,
 * rh_route_batch gives the position of the batch's first token; after it, rh_route_error
 * says what went wrong (NULL: nothing; a position past n_pos, an unexpected logits tensor),
 * and the graph stopped at that node (llama_decode may still return 0). */
int rh_set_route(rh_hook *h, rh_tensor_set tensor_set, int64_t n_pos, int32_t n_expert,
                 const int32_t *experts, const float *logits);
void rh_route_batch(rh_hook *h, int64_t first_step);
const char *rh_route_error(const rh_hook *h);

void rh_begin_batch(rh_hook *h, int32_t phase, int64_t first_step, int32_t n_tokens,
                    int32_t n_outputs, int32_t turn, int32_t strict);
int rh_end_batch(rh_hook *h);                /* 0, or an error: rh_error says which */
void rh_abort_batch(rh_hook *h);             /* a failed decode: release leases, drop events */
const char *rh_error(const rh_hook *h);
int32_t rh_n_events(const rh_hook *h);
/* every event of the batch at once: (n_events, 6) int64 rows (layer, phase, first_step, turn,
 * n_rows, offset into the arrays) into `meta`, and the (n_elems,) experts / weights arrays */
int64_t rh_events_elems(const rh_hook *h);
int rh_copy_events(const rh_hook *h, int64_t *meta, int32_t *experts, float *weights);
int32_t rh_final_stage(const rh_hook *h, int32_t layer);   /* -1 until the layer has routed */

#endif
