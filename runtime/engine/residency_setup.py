"""How the engine wires residency: the config, the manager, the load-time placement, and the
tiers that attach to a loaded engine (see contracts.md, Engine)."""
from __future__ import annotations

import os
import re
import sys

from runtime.native import ggml_lib, llama_lib
from runtime.native.build import STORE_LIB
from runtime.engine.placement import Placement, plan_placement
from runtime.engine.types import EngineSettings
from runtime.errors import UserError

_DEVICE_ORDER = ("cuda", "vulkan", "rpc", "cpu-slots", "cpu")   # fastest tier first: the hit
# rate shown


def residency_config(settings: EngineSettings):
    """The ResidencyConfig to run with (None when residency is off)."""
    if not settings.manage_residency:
        return None
    if settings.config is not None:
        return settings.config
    from runtime.residency.config import load_config  # noqa: PLC0415

    return load_config(settings.config_path)


def gpu_devices() -> list[ggml_lib.BackendDevice]:
    return [d for d in ggml_lib.devices() if d.kind != ggml_lib.GGML_BACKEND_DEVICE_TYPE_CPU]


def _gpu_memory(index: int) -> tuple[int, int] | None:
    """The GPU probe registered with the residency capacity code: (free, total) bytes."""
    gpus = gpu_devices()
    return (gpus[index].free_bytes, gpus[index].total_bytes) if index < len(gpus) else None


def build_manager(config, facts, *, has_gpu: bool, profile_path: str | None = None,
                  remote=None):
    """(manager, managed devices fastest first); (None, ()) when residency is off. Devices
    are the configured ones, or "cuda:0" / "cpu" when the config names none. A routing
    profile (``profile_path``) warm-starts every device's learned policies; one of another
    model is a UserError naming the file. ``remote`` (runtime.rpc.setup.RemoteSetup): a
    remote device cache's capacity is its plan's slot bytes."""
    if config is None:
        return None, ()
    from runtime.residency.capacity import (probe_device_memory,  # noqa: PLC0415
                                            register_gpu_memory_probe)
    from runtime.residency.manager import ExpertResidencyManager  # noqa: PLC0415

    if has_gpu:
        register_gpu_memory_probe(_gpu_memory)
    names = [b.device for b in config.devices] or ["cuda:0" if has_gpu else "cpu"]
    names.sort(key=lambda d: _DEVICE_ORDER.index(d.split(":")[0]))
    manager = ExpertResidencyManager(config)
    manager.bind_model(facts.expert_bytes, facts.n_expert, facts.n_expert_used)
    slots = remote.cache_slot_bytes() if remote is not None else {}
    for device in names:
        if device in slots:
            manager.reconfigure(device, slots[device])
            continue
        memory = probe_device_memory(device)
        free, total = memory if memory is not None else (None, None)
        manager.resolve_device(device, free_bytes=free, total_bytes=total)
    if profile_path is not None:
        from runtime.residency.profile import read_profile  # noqa: PLC0415

        profile = read_profile(profile_path)
        profile.check_model(facts.n_layer, facts.n_expert, facts.expert_bytes, profile_path)
        for device in names:
            manager.warm_start(device, profile)
    return manager, tuple(names)


def remote_config(settings: EngineSettings, config):
    """The config whose rpc:HOST:PORT devices this model uses (also with residency off), or
    None when it names none."""
    if config is None:
        if settings.config is not None:
            config = settings.config
        elif settings.config_path is not None:
            from runtime.residency.config import load_config  # noqa: PLC0415

            config = load_config(settings.config_path)
    return config if config is not None and getattr(config, "remotes", ()) else None


def library_dir(settings: EngineSettings, config) -> str | None:
    """The libllama directory to load, always our patched build: the settings' own, else
    $LLAMA_CPP_LIB_PATH, else the current build serving the config's cache devices (cuda:N a
    CUDA build, vulkan:N a Vulkan one), else this install's build. None in a process that
    already loaded llama.cpp (one process, one library: it stays). UserError, before anything
    loads, when no build serves them (runtime.native.lib_dir_for)."""
    if settings.lib_dir is not None:
        return settings.lib_dir
    if "llama_cpp" in sys.modules or "llama_cpp.llama_cpp" in sys.modules:
        return None
    from runtime.native import lib_dir_for  # noqa: PLC0415

    return lib_dir_for(_cache_devices(config))


def _has_ram_tier(settings: EngineSettings, config) -> bool:
    return settings.manage_residency and config is not None and \
        any(b.device == "cpu" for b in config.devices)


def lazy_experts(settings: EngineSettings, config, placement, lib_dir: str | None) -> bool:
    """Load the routed experts lazily (llama.cpp's LLAMA_LAZY_MODE_ON, which our build's
    llamacpp/patches/0006 extends to them): no prefetch of the whole file at load, no repacked
    copy, experts left in the mapping for the RAM tier to page. Only with a RAM tier, our
    patched library, and no expert placed on a GPU by a static rule (a lazy tensor stays on
    the host)."""
    lib = lib_dir or os.environ.get(llama_lib.LIB_PATH_ENV)
    return (_has_ram_tier(settings, config) and lib is not None
            and os.path.isfile(os.path.join(lib, STORE_LIB))
            and all(target == "cpu" for _, target in placement.rules))


def _cache_devices(config) -> set[str]:
    from runtime.residency.config import is_cache_device  # noqa: PLC0415

    return {b.device for b in config.devices
            if is_cache_device(b.device)} if config is not None else set()


def device_cache_ready(config, lib_dir: str | None) -> bool:
    """True when the config names a device-cache device and the libllama this process loads
    (``lib_dir`` from ``library_dir``, else $LLAMA_CPP_LIB_PATH) is the patched build that
    carries the cache."""
    if not _cache_devices(config):
        return False
    lib = lib_dir or os.environ.get(llama_lib.LIB_PATH_ENV)
    return lib is not None and os.path.isfile(os.path.join(lib, STORE_LIB))


def plan(settings: EngineSettings, config, facts, manager, *, has_gpu: bool,
         device_cache: bool) -> Placement:
    """The load-time placement for these settings (runtime/engine/placement.py). With a
    configured cuda:0 budget and no device cache (``device_cache``: see
    ``device_cache_ready``), the manager plans which layers' experts stay on the GPU and pins
    them there (bookkeeping only: the model loads after)."""
    configured = {b.device for b in config.devices} if config is not None else set()
    user_rules = tuple(settings.tensor_rules)
    cpu_layers: tuple[int, ...] = ()
    if user_rules and settings.manage_residency:
        cpu_layers = _check_user_rules(user_rules, facts)
    static = None
    if (settings.manage_residency and has_gpu and manager is not None
            and "cuda:0" in configured and not device_cache):
        static = manager.plan_static("cuda:0", skip=cpu_layers)
        manager.pin_static("cuda:0", static)
    return plan_placement(manage_residency=settings.manage_residency, static=static,
                          user_rules=user_rules)


def _check_user_rules(rules: tuple[tuple[str, str], ...], facts) -> tuple[int, ...]:
    """With the manager on: the MoE layers the rules keep on the CPU; a UserError (one line)
    when a rule would send routed experts to another device (the manager owns those)."""
    from runtime.engine.llama_flags import cpu_expert_layers, gpu_expert_tensors  # noqa: PLC0415

    by_layer: dict[int, list[str]] = {}
    pattern = re.compile(r"^blk\.(\d+)" + llama_lib.EXPERT_PATTERN)
    for name in facts.tensor_types:
        match = pattern.match(name)
        if match:
            by_layer.setdefault(int(match.group(1)), []).append(name)
    off_cpu = gpu_expert_tensors(list(rules), [n for names in by_layer.values() for n in names])
    if off_cpu:
        name, buft = off_cpu[0]
        raise UserError(f"-ot: a rule sends routed experts ({name}) to {buft}; with the "
                        "residency manager the GPU's experts come from its budget "
                        "(--devices.cuda:0 SIZE), or give --no-residency for llama.cpp's "
                        "placement")
    return cpu_expert_layers(list(rules), by_layer)


def buffer_type(target: str) -> int:
    """A placement target ("cpu" | "gpu" | a buffer type name, as llama.cpp's ``-ot`` takes
    it: "CPU", "CUDA0", ...) as a ggml buffer type; UserError naming the known ones."""
    if target == "cpu":
        return ggml_lib.cpu_buffer_type()
    if target == "gpu":
        return ggml_lib.device_buffer_type(gpu_devices()[0])
    known = {"CPU": ggml_lib.cpu_buffer_type()}
    for dev in ggml_lib.devices():
        if dev.kind != ggml_lib.GGML_BACKEND_DEVICE_TYPE_CPU:
            buft = ggml_lib.device_buffer_type(dev)
            known[ggml_lib.buffer_type_name(buft)] = buft
    for name, buft in known.items():
        if name.lower() == target.lower():
            return buft
    raise UserError(f"-ot: unknown buffer type {target!r} (here: {', '.join(known)})")


def attach_tiers(engine) -> list[object]:
    """Let the RAM tier / device cache attach; the engine's ResidencyObserver feeds
    every managed device none of them claimed. Returns the attached objects."""
    if engine.manager is None:
        return []
    configured = {b.device for b in engine.config.devices}
    attached, claimed = [], set()
    if "cpu" in configured:
        from runtime import ramtier  # noqa: PLC0415

        tier = ramtier.attach(engine)
        if tier is not None:
            attached.append(tier)
            claimed.add("cpu")
            # the CPU computes the experts (no GPU takes a prompt's matmuls from the mapping):
            # its matmuls wait per expert matrix, so the reads overlap the resident experts'
            if not gpu_devices() and engine.remote is None and \
                    ggml_lib.set_weight_ready(tier.io.weight_ready_pointer()):
                tier.io.set_async(True)
    cache_devices = _cache_devices(engine.config)
    if cache_devices:
        from runtime.native import device_cache  # noqa: PLC0415

        cache = device_cache.attach(engine)
        if cache is not None:
            attached.append(cache)
            claimed |= cache_devices
    fed = [d for d in engine.residency_devices if d not in claimed]
    if fed:                          # bookkeeping devices: the routing hook feeds them
        engine.hook.feed(engine.manager, fed)
    return attached
