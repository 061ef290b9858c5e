// device cache store: the slots' bytes (written from caller memory or the model's own tensors,
// read back for tests) and the expert -> slot tables (see device_cache_store.h for the rules).
#include "device_cache_store_impl.h"

#include <cstring>

static bool source_is_host(const ggml_tensor * t) {
    if (t->buffer == nullptr || !ggml_backend_buffer_is_host(t->buffer)) {
        return false;
    }
    // repacked CPU layouts (CPU_REPACK, AMX, KLEIDIAI) are not the file's bytes
    const char * name = ggml_backend_buft_name(ggml_backend_buffer_get_type(t->buffer));
    return strstr(name, "REPACK") == nullptr && strstr(name, "AMX") == nullptr && strstr(name, "KLEIDI") == nullptr;
}
// the slot tensor of (layer, proj) and the byte offset of `slot` in it, or nullptr
static ggml_tensor * slot_tensor(dc_store * c, int32_t layer, int32_t slot, int32_t proj, size_t * offset) {
    if (c == nullptr || layer < 0 || layer >= (int32_t) c->layers.size() || proj < 0 || proj >= DC_STORE_PROJ_COUNT) {
        return nullptr;
    }
    const dc_layer & l = c->layers[layer];
    if (l.pool < 0) {
        return nullptr;
    }
    dc_pool & p = c->pools[l.pool];
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
    const dc_layer & l = c->layers[layer];
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
    dc_layer & l = c->layers[layer];
    if (l.pool < 0 || expert < 0 || expert >= l.n_expert) {
        return DC_STORE_ERR_ARG;
    }
    dc_pool & p = c->pools[l.pool];
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
    const dc_layer & l = c->layers[layer];
    if (expert < 0 || expert >= l.n_expert) {
        return DC_STORE_ERR_ARG;
    }
    std::lock_guard<std::mutex> lock(c->table_mutex);
    *slot_out = l.table[expert];
    return DC_STORE_OK;
}
