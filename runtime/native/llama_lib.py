"""Low-level access to llama.cpp through llama-cpp-python 0.3.36's ctypes bindings.

What the high-level ``llama_cpp.Llama`` cannot do and the engine needs: pick the ``libllama``
directory before the bindings load (``LLAMA_CPP_LIB_PATH``), build ``tensor_buft_overrides``
(a NULL-terminated ``{const char *pattern; ggml_backend_buffer_type_t buft}`` array), attach
ggml-cpu threadpools to a context, and silence or show llama.cpp's log. ggml's own calls
(devices, buffer types, the weight-ready hook) are ggml_lib.py's; reading a ggml tensor inside
``cb_eval`` is ggml_tensor.py's.

Usage::

    select_library_dir(path)          # a patched build's directory, before anything else
    llama = bindings()                # imports llama_cpp (once)
    set_logging(verbose=False)
    overrides = BuftOverrides([(EXPERT_PATTERN, ggml_lib.cpu_buffer_type())])
    model = load_model(path, n_gpu_layers=0, overrides=overrides)
"""
from __future__ import annotations

import ctypes
import logging
import os
import sys
from collections import deque
from collections.abc import Callable, Sequence
from types import ModuleType

from runtime.native.interrupt import requested

LIB_PATH_ENV = "LLAMA_CPP_LIB_PATH"

# Routed-expert weight tensors (llama.cpp's own --cpu-moe pattern, plus merged gate_up).
EXPERT_PATTERN = r"\.ffn_(up|down|gate|gate_up)_(ch|)exps"


class BuftOverride(ctypes.Structure):
    """``struct llama_model_tensor_buft_override`` (llama.h)."""

    _fields_ = [("pattern", ctypes.c_char_p), ("buft", ctypes.c_void_p)]


# -- library selection ---------------------------------------------------------------------

def select_library_dir(path: str | os.PathLike[str] | None) -> None:
    """Choose the directory ``libllama.so`` loads from (None: leave the choice to
    ``bindings()``, which takes this install's build).

    Must run before ``llama_cpp`` is first imported in this process; afterwards only the
    directory already loaded is accepted (RuntimeError otherwise: one process, one library).
    """
    wanted = None if path is None else os.path.abspath(os.fspath(path))
    if "llama_cpp" in sys.modules or "llama_cpp.llama_cpp" in sys.modules:
        loaded = os.environ.get(LIB_PATH_ENV)
        loaded = None if loaded is None else os.path.abspath(loaded)
        if wanted is not None and wanted != loaded:
            raise RuntimeError(f"llama_cpp is already loaded from {loaded or 'the wheel'}; "
                               f"cannot switch to {wanted} in this process")
        return
    if wanted is None:
        return
    if not os.path.isfile(os.path.join(wanted, "libllama.so")):
        raise FileNotFoundError(f"{wanted}: no libllama.so in this directory")
    os.environ[LIB_PATH_ENV] = wanted


_bindings: ModuleType | None = None


def bindings() -> ModuleType:
    """The ``llama_cpp.llama_cpp`` ctypes module (imported once; backend initialised)."""
    global _bindings
    if _bindings is None:
        if "llama_cpp" not in sys.modules and not os.environ.get(LIB_PATH_ENV):
            from runtime.native import lib_dir_for  # noqa: PLC0415

            select_library_dir(lib_dir_for())    # this install's build (UserError: none)
        # a build with OpenMP (CMAKE_ARGS=-DGGML_OPENMP=ON; ours has none): its threads spin at
        # every barrier between graph ops, and on a busy machine a spinning thread takes the
        # core from the one doing the work (prefill 9x slower on a 2-core box with one busy
        # core, measured). libgomp reads it when it loads.
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
        import llama_cpp.llama_cpp as ll  # noqa: PLC0415 - must follow select_library_dir
        ll.llama_backend_init()
        _guard_amx(ll)
        _bindings = ll
    return _bindings


def cpu_has_amx() -> bool:
    """The CPU reports AMX int8 tiles (what ggml-cpu's AMX buffer type uses)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    flags = line.split()
                    return "amx_int8" in flags and "amx_tile" in flags
    except OSError:
        pass
    return False


AMX_NOTE = ("this libllama's AMX kernels crash on this CPU (ggml-org/llama.cpp#26954): extra "
            "CPU buffer types (AMX, repacking) are off; `moe-offload native build` makes a "
            "build with the fix")
amx_fallback: str | None = None     # AMX_NOTE when _guard_amx turned extra buffer types off


def _guard_amx(ll) -> None:
    """llama-cpp-python 0.3.36's ggml loads the AMX tile config from a stack temporary whose
    stores GCC drops: on an AMX CPU the first tile instruction raises SIGILL (or worse), in
    every q8_0/q4 matmul llama.cpp gives to its AMX buffer type. Our patched build carries the
    fix (llamacpp/patches/0003); for any other libllama on such a CPU, model loads default to no
    extra buffer types, so llama.cpp never picks AMX (this covers ``llama_cpp.Llama`` too)."""
    global amx_fallback
    if not cpu_has_amx() or hasattr(ll._lib, "llama_moe_cache_register"):
        return
    default_params = ll.llama_model_default_params

    def without_extra_bufts():
        params = default_params()
        params.use_extra_bufts = False
        return params

    ll.llama_model_default_params = without_extra_bufts
    amx_fallback = AMX_NOTE
    logging.getLogger("moe_offload").info("%s", AMX_NOTE)


class ThreadpoolParams(ctypes.Structure):
    """``struct ggml_threadpool_params`` (ggml.h)."""

    _fields_ = [("cpumask", ctypes.c_bool * 512), ("n_threads", ctypes.c_int),
                ("prio", ctypes.c_int), ("poll", ctypes.c_uint32), ("strict_cpu", ctypes.c_bool),
                ("paused", ctypes.c_bool)]


class Threadpools:
    """ggml-cpu threadpools attached to a context, one for generation and one for prompts:
    without them ggml-cpu (built without OpenMP) starts and joins its threads at every graph
    it computes, and a decode is ~150 graphs (the routing hook splits each layer's). ``poll``
    0: a thread with no graph to compute sleeps at once (no spinning between graphs). A count
    above a pool's size is what llama_set_n_threads may not ask for: the pools are sized at
    the most the engine uses."""

    def __init__(self, ctx: int, n_threads: int, n_threads_batch: int, *, poll: int = 0):
        bindings()
        cpu = ctypes.CDLL("libggml-cpu.so.0")
        cpu.ggml_threadpool_new.argtypes = [ctypes.POINTER(ThreadpoolParams)]
        cpu.ggml_threadpool_new.restype = ctypes.c_void_p
        cpu.ggml_threadpool_free.argtypes = [ctypes.c_void_p]
        cpu.ggml_threadpool_free.restype = None
        base = ctypes.CDLL("libggml-base.so.0")
        base.ggml_threadpool_params_default.argtypes = [ctypes.c_int]
        base.ggml_threadpool_params_default.restype = ThreadpoolParams
        lib = _bindings._lib
        lib.llama_attach_threadpool.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
        lib.llama_attach_threadpool.restype = None
        lib.llama_detach_threadpool.argtypes = [ctypes.c_void_p]
        lib.llama_detach_threadpool.restype = None
        self._cpu, self._lib, self._ctx = cpu, lib, ctx
        self.pools = []
        for n in dict.fromkeys((n_threads, n_threads_batch)):
            params = base.ggml_threadpool_params_default(n)
            params.poll = poll
            pool = cpu.ggml_threadpool_new(ctypes.byref(params))
            if not pool:
                self.close()
                raise RuntimeError(f"ggml_threadpool_new({n} threads) failed")
            self.pools.append((n, pool))
        by_size = dict(self.pools)
        lib.llama_attach_threadpool(ctx, by_size[n_threads], by_size[n_threads_batch])

    def forget_context(self) -> None:
        """The context was freed: nothing to detach from any more."""
        self._ctx = 0

    def close(self) -> None:
        if self._ctx:
            self._lib.llama_detach_threadpool(self._ctx)
            self._ctx = 0
        for _, pool in self.pools:
            self._cpu.ggml_threadpool_free(pool)
        self.pools = []


class BuftOverrides:
    """The NULL-terminated override array; keep this object alive as long as the model."""

    def __init__(self, rules: Sequence[tuple[str, int]]):
        self.rules = tuple((str(p), int(b)) for p, b in rules)
        self._patterns = [p.encode() for p, _ in self.rules]  # owned bytes for c_char_p
        self.array = (BuftOverride * (len(self.rules) + 1))()
        for i, (pattern, (_, buft)) in enumerate(zip(self._patterns, self.rules)):
            self.array[i].pattern = pattern
            self.array[i].buft = buft
        self.array[len(self.rules)].pattern = None   # terminator {NULL, NULL}
        self.array[len(self.rules)].buft = None

    @property
    def pointer(self) -> ctypes.c_void_p:
        return ctypes.cast(self.array, ctypes.c_void_p) if self.rules else ctypes.c_void_p(0)


# -- logging -------------------------------------------------------------------------------

class LogControl:
    """llama.cpp/ggml log sink: everything to stderr when verbose, else kept in a short ring
    (so a failed load can say why)."""

    def __init__(self) -> None:
        self.verbose = False
        self.recent: deque[str] = deque(maxlen=20)
        self.buffers: deque[str] = deque(maxlen=64)    # "... buffer size = X MiB" lines
        self._callback = bindings().llama_log_callback(self._on_log)
        bindings().llama_log_set(self._callback, ctypes.c_void_p(0))

    def _on_log(self, level: int, text: bytes, _user: int) -> None:
        message = text.decode("utf-8", errors="replace")
        if self.verbose:
            sys.stderr.write(message)
        if "buffer size =" in message:
            self.buffers.append(message.strip())
        if level in (3, 4) and message.strip():  # GGML_LOG_LEVEL_WARN, _ERROR (ggml.h)
            self.recent.append(message.strip())

    def last_error(self) -> str:
        """The last warning/error line llama.cpp logged, or ''."""
        return self.recent[-1] if self.recent else ""


_log: LogControl | None = None


def set_logging(verbose: bool) -> LogControl:
    """Route llama.cpp's log: shown on stderr when ``verbose``, otherwise silent."""
    global _log
    if _log is None:
        _log = LogControl()
    _log.verbose = verbose
    return _log


# -- loading -------------------------------------------------------------------------------

def load_model(path: str, *, n_gpu_layers: int, overrides: BuftOverrides | None = None,
               progress: Callable[[float], None] | None = None,
               use_mmap: bool = True, repack: bool = True, devices=None,
               tensor_split=None, lazy_experts: bool = False,
               use_mlock: bool = False) -> int:
    """``llama_model_load_from_file`` with default params plus ours; returns the model
    pointer or raises RuntimeError with llama.cpp's last logged complaint. ``repack=False``:
    no extra CPU buffer types (llama.cpp's --no-repack), so CPU weights stay in the mapping.
    ``devices``: a NULL-terminated ctypes array of ``ggml_backend_dev_t`` to offload to (None:
    every GPU-type device); ``tensor_split``: a ctypes ``float[llama_max_devices()]`` of
    layer proportions per device (None: by free memory). Both as runtime/rpc/setup.py makes them.
    ``lazy_experts``: LLAMA_LAZY_MODE_ON, which our patched build extends to the routed
    experts' weights (llamacpp/patches/0006): they are neither prefetched nor repacked.
    ``use_mlock``: lock the model's host pages in RAM (llama.cpp's --mlock)."""
    ll = bindings()
    params = ll.llama_model_default_params()
    params.n_gpu_layers = int(n_gpu_layers)
    params.use_extra_bufts = bool(repack) and amx_fallback is None
    if overrides is not None and overrides.rules:
        params.tensor_buft_overrides = overrides.pointer
    if devices is not None:
        params.devices = ctypes.cast(devices, ctypes.c_void_p)
    if tensor_split is not None:
        params.tensor_split = ctypes.cast(tensor_split, ctypes.POINTER(ctypes.c_float))
    callback = None
    if progress is not None:
        def on_progress(fraction: float, _user: int) -> bool:
            try:
                progress(float(fraction))
            except Exception:  # a progress bar must never abort a load
                pass
            return not requested()     # Ctrl-C came (interrupt.deferred): cancel the load
        callback = ll.llama_progress_callback(on_progress)
        params.progress_callback = callback
    # llama_load_mode: NONE = 0 (read into buffers), MLOCK = 2, MMAP_MLOCK = 3
    if use_mlock:
        params.load_mode = 3 if use_mmap else 2
    elif not use_mmap:
        params.load_mode = 0
    if lazy_experts:
        params.lazy_mode = ll.LLAMA_LAZY_MODE_ON
    model = ll.llama_model_load_from_file(path.encode(), params)
    del callback  # only used during the call
    if not model:
        why = _log.last_error() if _log is not None else ""
        raise RuntimeError(why or "llama.cpp could not load the model")
    return int(model)


def new_context(model: int, params) -> int:
    """``llama_init_from_model``; raises RuntimeError on failure."""
    ll = bindings()
    ctx = ll.llama_init_from_model(model, params)
    if not ctx:
        why = _log.last_error() if _log is not None else ""
        raise RuntimeError(why or "llama.cpp could not create a context")
    return int(ctx)
