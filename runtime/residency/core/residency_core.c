/* residency_core: see residency_core.h. This file: the rules of one access, in the order it
 * applies them, and replay's batch loop (a key's state changes in state.c; the other parts:
 * core_impl.h):
 *
 *  1. Checks first (layer, expert ids, offline inputs): a rejected call changes nothing.
 *  2. Membership is decided at entry: an element whose key is resident is a hit. Every element
 *     is touched in routing order (last access sequence number, use counts, next use; then
 *     the policies' own counts, their observe hooks); the call's keys are protected from
 *     eviction (touched at or after seq0).
 *  3. The lease of the call is taken; the layer's prefetch pins end; prefetched keys hit now
 *     count as used.
 *  4. Misses, once per distinct key in routing order: an unresolved pool means a transient
 *     use; otherwise victims are taken in the phase's eviction order (lowest first) from the
 *     key's pool, skipping protected keys (this call's, other leases', prefetch pins) until
 *     the key fits (take_victims); the admission policy may still refuse (transient). An
 *     admitted key is resident at once, its victims evicted.
 *  5. Prefetch (not in MIXED): the phase's planner names keys; each absent one is touched,
 *     then brought in while victims rank strictly below it (prefetch.c).
 */
#include "core_impl.h"
#include "order_heap.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

/* ---- access ---------------------------------------------------------------------------- */

static int access_static(rc_core *c, int32_t layer, const int32_t *el, int32_t n,
                         int32_t phase, int64_t lease_id, rc_result *out) {
    const int32_t base = layer * c->n_expert;
    c->seq += n;
    c->call++;
    int64_t *t = c->pools[c->pool_of_layer[layer]].counters[phase];
    int32_t m = 0;
    for (int32_t i = 0; i < n; i++) {
        const int32_t f = base + el[i];
        if (c->seen[f] == c->call) continue;
        c->seen[f] = c->call;
        if (c->state[f] > RESIDENT_MAX) {
            if (ivec_push(&c->r_transient, f) < 0) return RC_ERR_NOMEM;
            m++;
        }
    }
    if (lease_id > 0 && take_lease(c, lease_id, base, el, n) < 0) return RC_ERR_NOMEM;
    const int64_t mb = (int64_t) m * c->bytes_flat[base];
    t[C_ACCESSES] += n;
    if (m) {
        t[C_MISSES] += m;
        t[C_DEMAND_BYTES] += mb;
        t[C_TRANSIENT] += m;
        t[C_TRANSIENT_BYTES] += mb;
    }
    out->hits = n - m;
    out->misses = m;
    out->demand_miss_bytes = mb;
    out->n_transient = c->r_transient.n;
    out->transient = c->r_transient.v;
    return RC_OK;
}

static int transient(rc_core *c, int32_t f) {
    return ivec_push(&c->r_transient, f) < 0 || ivec_push(&c->r_miss_kind, 2) < 0
           ? RC_ERR_NOMEM : RC_OK;
}

static int handle_misses(rc_core *c, int32_t base, int32_t phase, int64_t seq0) {
    const int32_t o = c->pol.phase_order[phase];
    pool *p = pool_of(c, base);
    int64_t *t = p->counters[phase];
    const int64_t b = c->bytes_flat[base];
    const int32_t m = c->r_missed.n;
    t[C_MISSES] += m;
    t[C_DEMAND_BYTES] += (int64_t) m * b;
    for (int32_t i = 0; i < m; i++) {
        const int32_t f = c->r_missed.v[i];
        if (p->capacity < 0) {
            if (transient(c, f) != RC_OK) return RC_ERR_NOMEM;
            continue;
        }
        const int64_t free_b = p->capacity - p->resident_bytes;
        if (!take_victims(c, p, o, seq0, b - free_b, 0, f, NAN)) {
            if (transient(c, f) != RC_OK) return RC_ERR_NOMEM;
            continue;
        }
        if (!c->admit[phase].admit(c, phase, f, c->r_victims.v, c->r_victims.n)) {
            untake_victims(c, p, o);
            if (transient(c, f) != RC_OK) return RC_ERR_NOMEM;
            continue;
        }
        if (ivec_push(&c->r_admitted, f) < 0 || ivec_push(&c->r_miss_kind, 1) < 0)
            return RC_ERR_NOMEM;
        for (int32_t j = 0; j < c->r_victims.n; j++) {
            if (ivec_push(&c->r_evicted, c->r_victims.v[j]) < 0) return RC_ERR_NOMEM;
            evict(c, c->r_victims.v[j], phase);
        }
        if (make_resident(c, f, phase, 0) < 0) return RC_ERR_NOMEM;
        t[C_ADMISSIONS]++;
        t[C_ADMITTED_BYTES] += b;
    }
    const int32_t n_transient = c->r_transient.n;
    if (n_transient) {
        t[C_TRANSIENT] += n_transient;
        t[C_TRANSIENT_BYTES] += (int64_t) n_transient * b;
    }
    return RC_OK;
}

int core_access(rc_core *c, int32_t layer, const int32_t *el, int32_t n, int32_t phase,
                const int64_t *next_use, int32_t up_layer, const int32_t *up_experts,
                const int64_t *up_index, int32_t n_up, int64_t lease_id, int64_t release_id,
                rc_result *out) {
    result_reset(c);
    memset(out, 0, sizeof *out);
    if (release_id > 0) core_release(c, release_id);
    /* 1. checks: nothing changes on a rejected call */
    if (layer < 0 || layer >= c->n_layer || c->pool_of_layer[layer] < 0) {
        out->bad_value = layer;
        return RC_ERR_LAYER;
    }
    for (int32_t i = 0; i < n; i++)
        if (el[i] < 0 || el[i] >= c->n_expert) {
            out->bad_value = el[i];
            return RC_ERR_EXPERT;
        }
    if (c->is_static) return access_static(c, layer, el, n, phase, lease_id, out);
    if (c->planner[phase].needs_upcoming && up_layer < 0) return RC_ERR_UPCOMING;
    if (c->next_use != NULL && next_use == NULL) return RC_ERR_NEXT_USE;
    const int32_t base = layer * c->n_expert;
    const int32_t nf = c->n_flat;
    const int64_t seq0 = c->seq;
    int64_t seq = seq0;
    c->seq = seq0 + n;
    c->call++;
    const int64_t call = c->call;
    int32_t tr = 0;
    order_visit(c, layer, el, n, phase);
    if (prefetch_observe(c, layer, el, n, phase) < 0) return RC_ERR_NOMEM;
    /* 2. touch every element in routing order */
    for (int32_t i = 0; i < n; i++) {
        const int32_t f = base + el[i];
        const uint8_t s = c->state[f];
        if (s > RESIDENT_MAX) {
            if (c->seen[f] != call && (ivec_push(&c->r_missed, f) < 0 ||
                                       ivec_push(&c->r_missed_row, i) < 0))
                return RC_ERR_NOMEM;
        } else {
            if (s == 0) tr++;
            if (c->seen[f] != call) {             /* out of the orders while its key moves */
                order_discard(c, f);
                if (ivec_push(&c->r_touched, f) < 0) return RC_ERR_NOMEM;
            }
        }
        c->seen[f] = call;
        c->last_seq[f] = seq;
        c->uses[phase * nf + f]++;
        if (c->next_use != NULL) c->next_use[f] = next_use[i];
        seq++;
    }
    order_observe(c, layer, el, n, seq0);          /* the policies' own counts (lfu-decay's) */
    for (int32_t i = 0; i < c->r_touched.n; i++)   /* back in, at their new keys */
        if (order_add(c, c->r_touched.v[i]) < 0) return RC_ERR_NOMEM;
    /* 3. lease, pins, history, prefetch use */
    if (lease_id > 0 && take_lease(c, lease_id, base, el, n) < 0) return RC_ERR_NOMEM;
    unpin_layer(c, layer);
    if (c->last_experts != NULL) {
        ivec *h = &c->last_experts[phase * c->n_layer + layer];
        h->n = 0;
        for (int32_t i = 0; i < n; i++)
            if (ivec_push(h, el[i]) < 0) return RC_ERR_NOMEM;
        if (h->v == NULL && ivec_push(h, 0) == 0) h->n = 0;   /* recorded, even if empty */
    }
    pool *p = &c->pools[c->pool_of_layer[layer]];
    int64_t *t = p->counters[phase];
    t[C_ACCESSES] += n;
    if (c->n_pf_unused) {
        int32_t used = 0;
        for (int32_t i = 0; i < n; i++) {
            const int32_t f = base + el[i];
            if (c->pf_unused[f]) {
                c->pf_unused[f] = 0;
                used++;
                if (c->replay_batch >= 0 && ivec_push(&c->r_pf_used_row, i) < 0)
                    return RC_ERR_NOMEM;
            }
        }
        if (used) {
            c->n_pf_unused -= used;
            t[C_PF_USED_BYTES] += (int64_t) used * c->bytes_flat[base];
        }
    }
    if (phase != 1) tr = 0;
    t[C_TRANSITION_HITS] += tr;
    /* 4. misses */
    int rc = RC_OK;
    if (c->r_missed.n) rc = handle_misses(c, base, phase, seq0);
    /* 5. prefetch */
    if (rc == RC_OK && phase != 2 && c->planner[phase].plan != NULL) {
        rc_step_view s = {layer, n, phase, c->r_missed.n, up_layer, n_up, el, up_experts,
                          up_index, 0};
        while (s.first_next < c->n_moe && c->moe_layers[s.first_next] <= layer) s.first_next++;
        rc = run_prefetch(c, &s, seq0);
    }
    out->hits = n - c->r_missed.n;
    out->misses = c->r_missed.n;
    out->transition_hits = tr;
    out->demand_miss_bytes = (int64_t) c->r_missed.n * c->bytes_flat[base];
    result_out(c, out);
    return rc;
}

int core_replay(rc_core *c, int64_t n_batches, const int64_t *starts, const int32_t *layers,
                const int8_t *phases, const int32_t *experts, const int64_t *next_use,
                int32_t with_upcoming, int8_t *miss_kind, int64_t *pf_event) {
    rc_result r;
    c->log_batch.n = c->log_flat.n = 0;
    for (int64_t b = 0; b < n_batches; b++) {
        c->replay_batch = b;
        const int64_t s = starts[b], e = starts[b + 1];
        int32_t up_layer = -1, n_up = 0;
        const int32_t *up_e = NULL;
        int64_t *up_i = NULL;
        if (with_upcoming) {
            if (b + 1 < n_batches) {
                up_layer = layers[b + 1];
                up_e = experts + e;
                n_up = (int32_t) (starts[b + 2] - e);
                up_i = malloc((size_t) (n_up ? n_up : 1) * sizeof *up_i);
                if (up_i == NULL) return RC_ERR_NOMEM;
                for (int32_t i = 0; i < n_up; i++) up_i[i] = e + i;
            } else {
                up_layer = layers[b];   /* none after the last: an empty upcoming step */
            }
        }
        int rc = core_access(c, layers[b], experts + s, (int32_t) (e - s), phases[b],
                             next_use ? next_use + s : NULL, up_layer, up_e, up_i, n_up, 0, 0,
                             &r);
        free(up_i);
        if (rc != RC_OK) {
            c->replay_batch = -1;
            return rc;
        }
        if (miss_kind != NULL) {
            memset(miss_kind + s, 0, (size_t) (e - s));
            for (int32_t i = 0; i < c->r_missed.n; i++)
                miss_kind[s + c->r_missed_row.v[i]] = (int8_t) c->r_miss_kind.v[i];
            for (int32_t i = 0; i < c->r_pf_used_row.n; i++) {
                const int32_t row = c->r_pf_used_row.v[i];
                miss_kind[s + row] = 4;
                if (pf_event != NULL)
                    pf_event[s + row] = c->pf_event_of[layers[b] * c->n_expert + experts[s + row]];
            }
        }
    }
    c->replay_batch = -1;
    return RC_OK;
}

void rc_next_use(const int64_t *keys, int64_t n, int64_t n_keys, int64_t never, int64_t *out) {
    int64_t *last = malloc((size_t) (n_keys > 0 ? n_keys : 1) * sizeof *last);
    if (last == NULL) {
        for (int64_t i = 0; i < n; i++) out[i] = never;
        return;
    }
    for (int64_t k = 0; k < n_keys; k++) last[k] = never;
    for (int64_t i = n - 1; i >= 0; i--) {
        out[i] = last[keys[i]];
        last[keys[i]] = i;
    }
    free(last);
}
