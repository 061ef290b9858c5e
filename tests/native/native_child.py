"""Runs in a subprocess (one libllama per process): ``python native_child.py MODE JSON_ARGS``.

The parent sets ``LLAMA_CPP_LIB_PATH`` (the patched build; unset: the one the engine picks by
itself) and reads one JSON object from the last stdout line.

Modes:
  logits  {"model", "capacity" (bytes or null: no cache), "fill" ("all" | "even" | "shifted"),
           optional "extra_bufts" (true: llama.cpp's AMX / repacked CPU weights allowed),
           "prompt_tokens", "greedy", optional "device" (ggml device of the slots, "CPU"),
           "ngl" (0), "experts_on_cpu" (false), "flash_attn" (null: llama.cpp's choice)} -> {"logits_npy", "greedy", ...}: prompt logits (every
           token) and greedy continuation through the low-level API, with the device cache
           store made through runtime.native.device_cache_store and filled through dc_store_slot_load.
  capi    {"model"} -> results of C API calls (cffi).
  engine  {"model", "lib_dir", "slots" (a budget string or null), "policy", "prompt",
           "max_tokens", optional "device" ("cpu-slots"), "n_gpu_layers" (0), "repack" (null:
           the engine's choice)} -> {"tokens",
           "snapshot", "copies", ...}: the Engine with that cache device, greedy.
  churn   {"model", "capacity", "policy", "steps", "seed"} -> invariant checks of DeviceCache
           driven by random routing (a real manager, real slots, no decode).
  placement {"model", "placement" ("cpu-moe:N" | "planned"), "device", "slots",
           "n_gpu_layers"} -> {"buffers"}: the buffer type of each MoE layer's experts.
  ids     {"model", "capacity", "prompt_tokens"} -> the slot / cold ids the patched graph
           computed (read through cb_eval) for a prompt batch and one decode step.
  nodes   {"model", "capacity", "prompt_tokens"} -> {"plain": {...}, "cache": {...}}: the nodes
           of a one-token decode graph (every node the scheduler asks cb_eval about) without
           and with a device cache store, and how many of them are the slot path's "*_hot" nodes.
"""
from __future__ import annotations

import ctypes
import json
import os
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def _context(ll, model, n_ctx=256, flash_attn=None, eval_cb=None):
    cp = ll.llama_context_default_params()
    if eval_cb is not None:
        cp.cb_eval, cp.cb_eval_user_data = eval_cb
        _KEEP.append(eval_cb)
    cp.n_ctx, cp.n_batch, cp.n_ubatch = n_ctx, 64, 64
    if flash_attn is not None:
        cp.flash_attn_type = 1 if flash_attn else 0     # LLAMA_FLASH_ATTN_TYPE_ENABLED / DISABLED
    cp.n_threads = cp.n_threads_batch = 1      # 2 shared cores: spinning threads crawl
    return ll.llama_init_from_model(model, cp)


_KEEP: list = []      # ctypes objects llama.cpp points to while the model lives


def _load(ll, path, ngl: int = 0, experts_on_cpu: bool = False, extra_bufts: bool = True):
    """The model; ``ngl`` layers on the first GPU-like device, with ``experts_on_cpu`` every
    routed-expert tensor in a host buffer (how the engine loads for a device cache);
    ``extra_bufts=False``: no AMX / repacked CPU weights (llama.cpp's --no-repack).
    ``ll`` comes from ``llama_lib.bindings()``, which initialised the backend."""
    mp = ll.llama_model_default_params()
    mp.n_gpu_layers = ngl
    if not extra_bufts:
        mp.use_extra_bufts = False
    if experts_on_cpu:
        from runtime.native import ggml_lib, llama_lib
        overrides = llama_lib.BuftOverrides([(llama_lib.EXPERT_PATTERN,
                                              ggml_lib.cpu_buffer_type())])
        _KEEP.append(overrides)
        mp.tensor_buft_overrides = overrides.pointer
    model = ll.llama_model_load_from_file(path.encode(), mp)
    assert model, f"cannot load {path}"
    return model


def _prompt_and_greedy(ll, ctx, model, tokens, n_greedy):
    nv = ll.llama_vocab_n_tokens(ll.llama_model_get_vocab(model))
    ll.llama_memory_clear(ll.llama_get_memory(ctx), True)
    b = ll.llama_batch_init(len(tokens), 0, 1)
    for i, t in enumerate(tokens):
        b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = t, i, 1, 1
        b.seq_id[i][0] = 0
    b.n_tokens = len(tokens)
    assert ll.llama_decode(ctx, b) == 0
    logits = np.ctypeslib.as_array(ll.llama_get_logits(ctx), shape=(len(tokens) * nv,)).copy()
    ll.llama_batch_free(b)
    out, last = [], int(np.argmax(logits[-nv:]))
    for _ in range(n_greedy):
        out.append(last)
        one = (ctypes.c_int32 * 1)(last)
        assert ll.llama_decode(ctx, ll.llama_batch_get_one(one, 1)) == 0
        last = int(np.argmax(np.ctypeslib.as_array(ll.llama_get_logits_ith(ctx, -1), shape=(nv,))))
    return logits.reshape(len(tokens), nv), out


def mode_logits(args):
    from runtime.native.llama_lib import bindings
    ll = bindings()          # through ours: loads LLAMA_CPP_LIB_PATH's build
    model = _load(ll, args["model"], args.get("ngl", 0), args.get("experts_on_cpu", False),
                  args.get("extra_bufts", True))
    cache, resident, eval_cb = None, 0, None
    if args.get("capacity") is not None:
        from runtime.native.device_cache_store import DeviceCacheStore, load_store
        from runtime.native.device_cache_store import DeviceCacheError, ffi
        lib = load_store(os.environ["LLAMA_CPP_LIB_PATH"])
        try:
            cache = DeviceCacheStore.create(lib, model, args.get("device", "CPU"),
                                            args["capacity"], max_tokens=64)
        except DeviceCacheError as exc:
            return {"error": str(exc)}
        # the store's own cb_eval writes each cached layer's id planes from its table
        eval_cb = (ll.ggml_backend_sched_eval_callback(cache.eval_callback),
                   ctypes.c_void_p(int(ffi().cast("uintptr_t", cache.handle))))
        n_expert = args["n_expert"]
        shift = 1 if args["fill"] == "shifted" else 0
        # the bytes come from the file, as runtime.native.device_cache copies them (llama.cpp
        # may hold its own copy of the experts repacked for the CPU: not the file's layout)
        from gguf_tools.expert_index import ExpertIndex
        from runtime.native.device_cache import ExpertSource
        source = ExpertSource(args["model"], ExpertIndex.open(args["model"]))

        def load(layer, expert, slot):
            for proj, offset, stride in source.parts[layer]:
                cache.slot_set(layer, slot, proj, source.base + offset + expert * stride, stride)

        slot = 0
        for layer in range(cache.n_layer):
            pool, _ = cache.layer_info(layer)
            if pool < 0:
                continue
            n_slots, _ = cache.pool_info(pool)
            for e in range(n_expert):
                if slot >= n_slots or (args["fill"] == "even" and (e + layer) % 2):
                    continue
                load(layer, (e + shift) % n_expert, slot)
                cache.table_set(layer, e, slot)
                slot += 1
        resident = slot
    ctx = _context(ll, model, flash_attn=args.get("flash_attn"), eval_cb=eval_cb)
    logits, greedy = _prompt_and_greedy(ll, ctx, model, args["prompt_tokens"], args["greedy"])
    out = Path(args["out"])
    np.save(out, logits)
    if cache is not None:
        cache.close()
    return {"logits_npy": str(out), "greedy": greedy, "resident": resident,
            "lib": str(Path(ll._lib._name).parent)}


def mode_capi(args):
    from runtime.native.llama_lib import bindings
    ll = bindings()          # through ours: loads LLAMA_CPP_LIB_PATH's build
    from runtime.native.device_cache_store import (DeviceCacheError, DeviceCacheStore, ffi,
                                                   load_store)
    model = _load(ll, args["model"])
    lib = load_store(os.environ["LLAMA_CPP_LIB_PATH"])
    f = ffi()
    res = {}
    out = f.new("dc_store_t *")
    res["unknown_device"] = lib.dc_store_create(f.cast("struct llama_model *", model),
                                                b"NoSuchDevice0", 1 << 20, 64, out)
    res["null_model"] = lib.dc_store_create(f.NULL, b"CPU", 1 << 20, 64, out)
    res["zero_tokens"] = lib.dc_store_create(f.cast("struct llama_model *", model), b"CPU",
                                             1 << 20, 0, out)
    zero = DeviceCacheStore.create(lib, model, "CPU", 0, max_tokens=64)
    res["zero_slots"] = zero.pool_info(0)[0]
    res["zero_allocated"] = zero.allocated_bytes()
    zero.close()
    c = DeviceCacheStore.create(lib, model, "CPU", args["capacity"], max_tokens=16)
    res["n_layer"], res["n_pool"] = c.n_layer, c.n_pool
    res["layers"] = [c.layer_info(layer) for layer in range(c.n_layer)]
    res["pool"] = c.pool_info(0)
    res["proj_bytes"] = [c.proj_bytes(0, p) for p in range(4)]
    res["allocated"] = c.allocated_bytes()
    # slot_load copies the model's own bytes: read them back and compare with the file
    c.slot_load(1, 5, 2)
    res["slot_down_l1_e5"] = c.slot_get(1, 2, 2).hex()
    # a slot written from caller memory reads back the same
    n = c.proj_bytes(0, 0)
    payload = bytes(range(256)) * (n // 256) + bytes(n % 256)
    buf = f.from_buffer("char[]", payload)
    c.slot_set(0, 1, 0, buf, n)
    res["roundtrip"] = c.slot_get(0, 1, 0) == payload
    n_used = args["n_used"]
    errors = {}
    for name, call in {
        "slot_set_wrong_size": lambda: c.slot_set(0, 1, 0, buf, n - 1),
        "slot_out_of_range": lambda: c.slot_load(0, 0, res["pool"][0]),
        "expert_out_of_range": lambda: c.slot_load(0, 10_000, 0),
        "table_bad_slot": lambda: c.table_set(0, 0, res["pool"][0]),
        "layer_out_of_range": lambda: c.table_set(99, 0, 0),
        "route_bad_expert": lambda: c.route(0, [[0, 10_000] + [1] * (n_used - 2)]),
        "route_bad_layer": lambda: c.route(99, [list(range(n_used))]),
    }.items():
        try:
            call()
            errors[name] = "accepted"
        except DeviceCacheError as exc:
            errors[name] = str(exc)
    c.table_set(0, 3, 0)
    res["table_0_3"] = c.table_get(0, 3)
    res["table_0_4"] = c.table_get(0, 4)
    try:
        c.table_set(1, 4, 0)          # slot 0 already holds (0, 3): refused
        errors["slot_taken"] = "accepted"
    except DeviceCacheError as exc:
        errors["slot_taken"] = str(exc)
    c.table_set(0, 3, -1)
    c.table_set(1, 4, 0)              # free again: accepted
    res["table_1_4"] = c.table_get(1, 4)
    res["errors"] = errors
    c.close()
    return res


def mode_engine(args):
    from runtime.engine.engine import Engine, EngineSettings, SamplingParams
    from runtime.residency.config import parse_config
    devices = {args.get("device", "cpu-slots"): args["slots"]} if args.get("slots") else {}
    config = parse_config({"devices": devices, "policy": {
        "phase_specific": False, "decode": {"admission": "always", "prefetch": "none",
                                            "eviction": args.get("policy", "lru")}}},
        source="<test>") if devices else None
    settings = EngineSettings(model_path=args["model"], n_ctx=512, n_threads=1,
                              n_threads_batch=1, n_batch=64, n_ubatch=64,
                              n_gpu_layers=args.get("n_gpu_layers", 0),
                              manage_residency=config is not None, config=config,
                              lib_dir=args.get("lib_dir"), repack=args.get("repack"))
    engine = Engine(settings, progress=False)
    params = SamplingParams(max_tokens=args["max_tokens"], temperature=0.0, seed=1)
    tokens = [c.token for c in engine.generate(args["prompt"], params) if c.token is not None]
    res = {"tokens": tokens}
    attached = [a for a in getattr(engine, "_attached", []) if hasattr(a, "caches")]
    if attached:
        cache = attached[0].caches[0]
        res.update(copies=cache.copies, refused=cache.refused, failures=cache.copy_failures,
                   resident=len(cache.slot_of), slots=sum(
                       cache.store.pool_info(p)[0] for p in range(cache.store.n_pool)))
    if engine.manager is not None:
        res["snapshot"] = engine.manager.snapshot().to_dict()
    engine.close()
    return res


def mode_placement(args):
    """Where each MoE layer's expert tensors were loaded: {"buffers": [buft name per layer]}
    for the Engine with ``placement`` ("cpu-moe:N" static, or "planned" with a cache device)."""
    from runtime.native import ggml_tensor
    from runtime.engine.engine import Engine, EngineSettings
    from runtime.engine.placement import cpu_moe_placement
    from runtime.residency.config import parse_config

    placement, config = None, None
    if args["placement"].startswith("cpu-moe:"):
        placement = cpu_moe_placement(int(args["placement"].split(":")[1]))
    else:
        config = parse_config({"devices": {args["device"]: args["slots"]}}, source="<test>")
    engine = Engine(EngineSettings(model_path=args["model"], n_ctx=256, n_threads=1,
                                   n_gpu_layers=args.get("n_gpu_layers", 0),
                                   manage_residency=config is not None, config=config,
                                   lib_dir=args.get("lib_dir")),
                    progress=False, placement=placement)
    lib = ctypes.CDLL(os.path.join(os.environ["LLAMA_CPP_LIB_PATH"], "libllama.so"))
    lib.llama_moe_cache_model_tensor.restype = ctypes.c_void_p
    lib.llama_moe_cache_model_tensor.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
    names = [ggml_tensor.tensor_buffer_type_name(lib.llama_moe_cache_model_tensor(
                 engine.model_ptr, f"blk.{layer}.ffn_up_exps.weight".encode()))
             for layer in engine.facts.moe_layers]
    engine.close()
    return {"buffers": names}


def mode_ids(args):
    from runtime.native.llama_lib import bindings
    ll = bindings()          # through ours: loads LLAMA_CPP_LIB_PATH's build
    from runtime.native import ggml_tensor
    from runtime.native.device_cache_store import DeviceCacheStore, load_store

    model = _load(ll, args["model"])
    seen: dict[str, list] = {}

    cache = DeviceCacheStore.create(load_store(os.environ["LLAMA_CPP_LIB_PATH"]), model, "CPU",
                                    args["capacity"], max_tokens=64)

    @ll.ggml_backend_sched_eval_callback
    def on_eval(tensor, ask, user_data):
        name = ggml_tensor.tensor_name(tensor).decode()
        wanted = name.startswith(("ffn_moe_hot_ids-", "ffn_moe_cold_ids-", "ffn_moe_pick-",
                                  "ffn_moe_topk-")) and " " not in name
        if ask:
            return wanted
        if wanted:
            arr = ggml_tensor.read_tensor(tensor)              # (1, 1, n_tokens, n_expert_used)
            arr = arr.reshape(arr.shape[-2], arr.shape[-1])
            seen.setdefault(name, []).append(arr.tolist())
            if name.startswith("ffn_moe_topk-"):             # as the routing hook does
                cache.route(int(name.rsplit("-", 1)[1]), arr)
        return True

    cp = ll.llama_context_default_params()
    cp.n_ctx, cp.n_batch, cp.n_ubatch = 256, 64, 64
    cp.n_threads = cp.n_threads_batch = 1
    cp.cb_eval, cp.cb_eval_user_data = on_eval, None
    ctx = ll.llama_init_from_model(model, cp)
    n_slots, _ = cache.pool_info(0)
    for layer in range(cache.n_layer):           # every other expert resident
        for e in range(0, 16, 2):
            slot = layer * 8 + e // 2
            if slot < n_slots:
                cache.slot_load(layer, e, slot)
                cache.table_set(layer, e, slot)
    _prompt_and_greedy(ll, ctx, model, args["prompt_tokens"], 1)
    cache.close()
    return {"seen": seen, "n_slots": n_slots}


def mode_nodes(args):
    import re
    from runtime.native.llama_lib import bindings
    ll = bindings()          # through ours: loads LLAMA_CPP_LIB_PATH's build
    from runtime.native import ggml_tensor
    from runtime.native.device_cache_store import DeviceCacheStore, load_store

    model = _load(ll, args["model"])
    state = {"cache": None, "nodes": 0, "hot": 0}

    @ll.ggml_backend_sched_eval_callback
    def on_eval(tensor, ask, user_data):
        name = ggml_tensor.tensor_name(tensor).decode()
        topk = state["cache"] is not None and re.fullmatch(r"ffn_moe_topk-\d+", name)
        if ask:
            state["nodes"] += 1
            state["hot"] += bool(re.fullmatch(r"ffn_moe_\w+_hot-\d+", name))
            return bool(topk)
        if topk:                                         # as the routing hook does
            arr = ggml_tensor.read_tensor(tensor)
            state["cache"].route(int(name.rsplit("-", 1)[1]), arr.reshape(arr.shape[-2], -1))
        return True

    out = {}
    for label, capacity in (("plain", None), ("cache", args["capacity"])):
        cache = None
        if capacity:
            cache = DeviceCacheStore.create(load_store(os.environ["LLAMA_CPP_LIB_PATH"]), model,
                                            "CPU", capacity, max_tokens=64)
            n_slots, _ = cache.pool_info(0)
            for layer in range(cache.n_layer):
                for e in range(0, 16, 2):
                    slot = layer * 8 + e // 2
                    if slot < n_slots:
                        cache.slot_load(layer, e, slot)
                        cache.table_set(layer, e, slot)
        state["cache"] = cache
        cp = ll.llama_context_default_params()
        cp.n_ctx, cp.n_batch, cp.n_ubatch = 256, 64, 64
        cp.n_threads = cp.n_threads_batch = 1
        cp.cb_eval, cp.cb_eval_user_data = on_eval, None
        ctx = ll.llama_init_from_model(model, cp)
        tokens = args["prompt_tokens"]
        b = ll.llama_batch_init(len(tokens), 0, 1)
        for i, t in enumerate(tokens):
            b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = t, i, 1, int(i == len(tokens) - 1)
            b.seq_id[i][0] = 0
        b.n_tokens = len(tokens)
        assert ll.llama_decode(ctx, b) == 0
        ll.llama_batch_free(b)
        state["nodes"] = state["hot"] = 0
        one = (ctypes.c_int32 * 1)(tokens[-1])
        assert ll.llama_decode(ctx, ll.llama_batch_get_one(one, 1)) == 0
        out[label] = {"nodes": state["nodes"], "hot": state["hot"]}
        ll.llama_free(ctx)
        if cache is not None:
            cache.close()
    return out


def mode_churn(args):
    from runtime.native.llama_lib import bindings
    ll = bindings()          # through ours: loads LLAMA_CPP_LIB_PATH's build
    from types import SimpleNamespace
    from gguf_tools.expert_index import ExpertIndex
    from runtime.native.device_cache import DeviceCache, ExpertSource
    from runtime.native.device_cache_store import PROJ_BY_TENSOR, DeviceCacheStore, load_store
    from runtime.residency.transport import claim_device
    from runtime.residency.config import parse_config
    from runtime.residency.manager import ExpertResidencyManager
    from runtime.residency.types import ExpertKey, Phase

    model = _load(ll, args["model"])
    index = ExpertIndex.open(args["model"])
    facts = index.facts
    config = parse_config({"devices": {"cpu-slots": args["capacity"]}, "policy": {
        "phase_specific": True,
        "prefill": {"admission": "always", "prefetch": "none", "eviction": "lru"},
        "decode": {"admission": "always", "prefetch": "none", "eviction": args["policy"]}}},
        source="<churn>")
    manager = ExpertResidencyManager(config)
    manager.bind_model(facts.expert_bytes, facts.n_expert)
    manager.resolve_device("cpu-slots", free_bytes=None, total_bytes=None)
    store = DeviceCacheStore.create(load_store(os.environ["LLAMA_CPP_LIB_PATH"]), model, "CPU",
                                    manager.capacity("cpu-slots"), max_tokens=8)
    cache = DeviceCache(manager, "cpu-slots", store, ExpertSource(args["model"], index),
                        n_used=facts.n_expert_used)
    manager.set_pools("cpu-slots", cache.pools())              # as attach() does
    claim_device(manager, "cpu-slots", cache)
    if args.get("fail_every"):         # the real failure path of a copy, every Nth copy
        cache.fail_every(args["fail_every"])
    rng = np.random.default_rng(args["seed"])
    popularity = 1.0 / np.arange(1, facts.n_expert + 1) ** 1.2
    popularity /= popularity.sum()
    file = open(args["model"], "rb")
    checks = mismatches = 0
    for step in range(args["steps"]):
        phase = Phase.PREFILL if step % 50 < 10 else Phase.DECODE
        n_tokens = 8 if phase == Phase.PREFILL else 1
        for layer in facts.moe_layers:
            experts = np.stack([rng.choice(facts.n_expert, facts.n_expert_used, replace=False,
                                           p=popularity) for _ in range(n_tokens)])
            cache.on_route(SimpleNamespace(layer=layer, phase=phase, first_step=step,
                                           experts=experts.astype(np.int32)))
        cache.on_batch_end(phase, n_tokens)
        if step % 25 == 24:
            cache.settle()
            resident = cache.resident()
            for layer in facts.moe_layers:
                mask = manager.resident_mask("cpu-slots", layer)
                for e in range(facts.n_expert):
                    key = ExpertKey(layer, e)
                    slot = store.table_get(layer, e)
                    checks += 1
                    if (slot >= 0) != bool(mask[e]) or resident.get(key, -1) != slot:
                        mismatches += 1
                    if slot >= 0:       # the slot holds exactly this expert's file bytes
                        for r in index.ranges(layer, e):
                            proj = PROJ_BY_TENSOR[r.tensor.split(".")[-2]]
                            file.seek(r.offset)
                            if store.slot_get(layer, slot, proj) != file.read(r.length):
                                mismatches += 1
            manager.verify()
    snap = manager.snapshot().to_dict()["devices"]["cpu-slots"]
    out = {"checks": checks, "mismatches": mismatches, "copies": cache.copies,
           "refused": cache.refused, "failures": cache.copy_failures,
           "evictions": sum(p["evictions"] for p in snap["phases"].values()),
           "resident_experts": snap["resident_experts"],
           "resident": len(cache.resident()),
           "slots": store.pool_info(0)[0]}
    cache.close()
    return out


if __name__ == "__main__":
    mode, raw = sys.argv[1], sys.argv[2]
    result = {"logits": mode_logits, "capi": mode_capi, "engine": mode_engine,
              "churn": mode_churn, "ids": mode_ids, "nodes": mode_nodes, "placement": mode_placement}[mode](
                 json.loads(raw))
    sys.stdout.write("\n" + json.dumps(result) + "\n")
