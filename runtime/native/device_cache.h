/* device_cache: the device cache's mechanism, in C (one dc_cache per cache device).
 *
 * The residency core (rc_core, the manager's) decides; this moves bytes: per layer-step
 * (dc_route) it publishes finished copies into the slot tables of the device cache store
 * (llamacpp/device_cache/device_cache_store.h: dc_store_table_set), asks the core (rc_step: one
 * lease per layer-step, the previous one released), clears the victims' table entries and
 * frees their slots, copies each admitted or prefetched expert from the read-only file
 * mapping into a free slot of its pool on worker threads (dc_store_slot_set), and last writes
 * the layer's id planes from the table as it then is (dc_store_route: which path computes
 * each routed pair in this layer-step). A prefill layer waits for its own copies; a decode
 * layer does not (the expert runs cold until its copy is published). dc_batch_end waits for
 * every copy the batch started and publishes: between batches the tables hold exactly the
 * core's resident set. A copy that fails frees its slot and the expert leaves the core
 * (rc_forget).
 *
 * Called from the routing hook's native mode (route_hook.c) or from Python
 * (runtime/native/device_cache.py: the reference hook, tests); the same code either way.
 */
#ifndef DEVICE_CACHE_H
#define DEVICE_CACHE_H
#include <stddef.h>
#include <stdint.h>

typedef struct dc_cache dc_cache;
typedef int (*dc_table_set_fn)(void *cache, int32_t layer, int32_t expert, int32_t slot);
typedef int (*dc_slot_set_fn)(void *cache, int32_t layer, int32_t slot, int32_t proj,
                              const void *src, size_t nbytes);
typedef int (*dc_route_fn)(void *cache, int32_t layer, const int32_t *ids, int32_t n_tokens);

/* store: a dc_store_t; pool_of_layer[n_layer]: the store's pool (-1: none), slots[n_pool]:
 * assignable slots */
dc_cache *dc_create(void *core, void *store, dc_table_set_fn table_set, dc_slot_set_fn slot_set,
                    dc_route_fn route, int32_t n_used,
                    int32_t n_layer, int32_t n_expert, const int32_t *pool_of_layer,
                    int32_t n_pool, const int32_t *slots, const char *file_base,
                    int32_t workers, int32_t wait_in_prefill);
/* where a layer's expert e lives in the file: part i at file_base + offset[i] + e * stride[i] */
int dc_set_parts(dc_cache *c, int32_t layer, int32_t n, const int32_t *proj,
                 const int64_t *offset, const int64_t *stride);
void dc_free(dc_cache *c);
/* experts of at most ``nbytes`` (all projections) are copied on the calling thread, inside
 * the layer-step, and published at once; larger ones on the workers (default 0: all) */
void dc_set_inline_bytes(dc_cache *c, int64_t nbytes);                  /* finishes the copies in flight first */

/* transport side (the manager's decisions made elsewhere, e.g. manager.prefetch) */
int dc_submit(dc_cache *c, int32_t flat, int32_t prefetch);
void dc_drop(dc_cache *c, int32_t flat);

/* observer side; a non-zero status: the core refused (RC_ERR_*), or -100 - the store's status
 * when the id planes could not be written */
int dc_route(dc_cache *c, int32_t layer, const int32_t *experts, int32_t n, int32_t phase);
void dc_batch_end(dc_cache *c);
void dc_publish(dc_cache *c);
void dc_settle(dc_cache *c);

int32_t dc_slot_of(const dc_cache *c, int32_t flat);     /* published slot, or -1 */
int64_t dc_stat(const dc_cache *c, int32_t which);        /* 0 copies, 1 failures, 2 refused,
                                                             3 copied bytes */
const char *dc_error(const dc_cache *c);                 /* the last failed copy, or "" */
void dc_fail_every(dc_cache *c, int32_t n);               /* tests: every nth copy fails */

#endif
