/* route_hook's consumers (route_hook.h: RH_CONSUMER_*): one list, each entry a kind's
 * (step, batch_end, error) over its object. */
#include "route_hook_impl.h"
#include "../../native/device_cache.h"
#include "../../ramtier/tier_io.h"
#include "../../residency/core/residency_core.h"

#include <stdio.h>

/* a bookkeeping core: the decisions, nothing moved */
static int core_step(consumer *u, const step_event *e) {
    rc_result r;
    return rc_step(u->obj, &u->held, e->layer, e->experts, e->n, e->phase, &r);
}
static int core_end(consumer *u) { rc_step_end(u->obj, &u->held); return 0; }
static void core_error(const consumer *u, int32_t layer, int status, char *msg, int32_t cap) {
    (void) u;
    rc_step_message(msg, cap, "", layer, status);
}

/* a device cache: copies into slots, the id planes (device_cache.h; it holds its own lease) */
static int cache_step(consumer *u, const step_event *e) {
    return dc_route(u->obj, e->layer, e->experts, e->n, e->phase);
}
static int cache_end(consumer *u) { dc_batch_end(u->obj); return 0; }
static void cache_error(const consumer *u, int32_t layer, int status, char *msg, int32_t cap) {
    (void) u;
    if (status <= -100)
        snprintf(msg, (size_t) cap, "device cache: layer %d: the id planes could not be written "
                 "(dc_store_route status %d)", layer, -100 - status);
    else
        rc_step_message(msg, cap, "device cache: ", layer, status);
}

/* a RAM tier: the layer's missing experts queued (and, without the matmul's hook, read) */
static int tier_step(consumer *u, const step_event *e) {
    return rt_step(u->obj, e->layer, e->experts, e->n, e->phase);
}
static int tier_end(consumer *u) { return rt_batch_end(u->obj); }
static void tier_error(const consumer *u, int32_t layer, int status, char *msg, int32_t cap) {
    (void) layer; (void) status;
    snprintf(msg, (size_t) cap, "%s", rt_error(u->obj));
}

/* the synchronous observers (Python's): one adapter, the event handed over as it happens */
static int observer_step(consumer *u, const step_event *e) {
    const rh_hook *h = u->obj;
    return h->observer(e->layer, e->phase, e->first_step, e->turn, e->n_rows, e->experts,
                       e->weights, h->observer_user);
}
static int observer_end(consumer *u) { (void) u; return 0; }  /* Python ends its observers' batch */
static void observer_error(const consumer *u, int32_t layer, int status, char *msg,
                           int32_t cap) {
    (void) u; (void) status;
    snprintf(msg, (size_t) cap, "layer %d: a routing observer failed", layer);
}

static const consumer_kind k_kinds[] = {
    [RH_CONSUMER_CORE] = {core_step, core_end, core_error},
    [RH_CONSUMER_CACHE] = {cache_step, cache_end, cache_error},
    [RH_CONSUMER_TIER] = {tier_step, tier_end, tier_error},
    [RH_CONSUMER_OBSERVER] = {observer_step, observer_end, observer_error},
};

/* a consumer's RH_CONSUMER_* kind: its entry's index in k_kinds */
static int32_t kind_of(const consumer *u) { return (int32_t) (u->kind - k_kinds); }

static int add_consumer(rh_hook *h, int32_t kind, void *obj) {
    if (kind < 0 || kind > RH_CONSUMER_OBSERVER || obj == NULL ||
        h->n_consumers >= MAX_CONSUMERS)
        return -1;
    int32_t at = h->n_consumers;                    /* after every entry of its kind or before */
    while (at > 0 && kind_of(&h->consumers[at - 1]) > kind) {
        h->consumers[at] = h->consumers[at - 1];
        at--;
    }
    h->consumers[at] = (consumer) {&k_kinds[kind], obj, 0};
    h->n_consumers++;
    return 0;
}

int rh_add_consumer(rh_hook *h, int32_t kind, void *obj) {
    return kind == RH_CONSUMER_OBSERVER ? -1 : add_consumer(h, kind, obj);
}

void rh_set_observer(rh_hook *h, rh_event_cb cb, void *user_data) {
    rh_clear_consumers(h, RH_CONSUMER_OBSERVER);
    h->observer = cb;
    h->observer_user = user_data;
    if (cb != NULL) add_consumer(h, RH_CONSUMER_OBSERVER, h);
}

void rh_clear_consumers(rh_hook *h, int32_t kind) {
    int32_t n = 0;
    for (int32_t i = 0; i < h->n_consumers; i++)
        if (kind_of(&h->consumers[i]) != kind) h->consumers[n++] = h->consumers[i];
    h->n_consumers = n;
}

