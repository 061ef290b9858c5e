"""Model loading with a progress bar, and the context parameters the engine runs with."""
from __future__ import annotations

import os
import sys

from runtime.native import interrupt, llama_lib
from runtime.engine.types import FLASH_ATTN, EngineSettings
from runtime.errors import UserError


def load_with_progress(settings: EngineSettings, overrides: llama_lib.BuftOverrides, *,
                       progress: bool = True, repack: bool = True, remote=None,
                       lazy_experts: bool = False) -> int:
    """Load the model (a tqdm bar on stderr while llama.cpp reports progress); returns the
    ``llama_model *``. A file llama.cpp refuses is a UserError naming it. ``remote``: a
    runtime.rpc.setup.RemoteSetup (its devices, tensor_split and n_gpu_layers win)."""
    from tqdm import tqdm  # noqa: PLC0415

    bar = tqdm(total=100, desc=f"loading {os.path.basename(settings.model_path)}", unit="%",
               file=sys.stderr, leave=False, disable=not progress or None,
               bar_format="{desc}: {percentage:3.0f}%|{bar}| {elapsed}")

    def on_progress(fraction: float) -> None:
        bar.update(max(0, int(fraction * 100) - bar.n))

    try:
        # Ctrl-C while loading: the progress callback cancels the load, then it is raised
        with interrupt.deferred():
            ngl = settings.n_gpu_layers
            if remote is not None and remote.n_gpu_layers is not None:
                ngl = remote.n_gpu_layers
            return llama_lib.load_model(
                settings.model_path, n_gpu_layers=ngl, overrides=overrides,
                progress=on_progress, repack=repack, lazy_experts=lazy_experts,
                use_mmap=settings.use_mmap, use_mlock=settings.use_mlock,
                devices=remote.devices if remote is not None else None,
                tensor_split=remote.tensor_split if remote is not None else None)
    except RuntimeError as exc:
        raise UserError(f"{settings.model_path}: llama.cpp cannot load it ({exc})") from None
    finally:
        bar.close()


def thread_counts(settings: EngineSettings) -> tuple[int, int]:
    """(generation, prompt) threads at most: -t (which sets both, as in llama.cpp) and -tb,
    else every core. Each call runs on that many or on one, whichever measures faster
    (runtime/engine/threads.py)."""
    cores = os.cpu_count() or 1
    n_threads = settings.n_threads or cores
    n_threads_batch = settings.n_threads_batch or settings.n_threads or cores
    return n_threads, n_threads_batch


def thread_tuner(settings: EngineSettings):
    """The engine's ThreadTuner over ``thread_counts(settings)``."""
    from runtime.engine.threads import ThreadTuner  # noqa: PLC0415

    return ThreadTuner(*thread_counts(settings))


# llama_pooling_type by name (None: LLAMA_POOLING_TYPE_UNSPECIFIED, the model's own)
POOLING = {None: -1, "none": 0, "mean": 1, "cls": 2, "last": 3, "rank": 4}


def make_context_params(settings: EngineSettings, hook) -> object:
    """``llama_context_params`` from llama.cpp's defaults plus the settings; ``hook`` (a
    RoutingHook or None) becomes ``cb_eval``. Batch sizes are clamped as llama-cpp-python
    does (n_batch <= n_ctx, n_ubatch <= n_batch)."""
    ll = llama_lib.bindings()
    params = ll.llama_context_default_params()
    params.n_ctx = settings.n_ctx
    n_batch = min(settings.n_ctx, settings.n_batch) if settings.n_ctx > 0 else settings.n_batch
    params.n_batch = n_batch
    params.n_ubatch = min(n_batch, settings.n_ubatch)
    params.n_threads, params.n_threads_batch = thread_counts(settings)
    params.flash_attn_type = FLASH_ATTN[settings.flash_attn]
    if settings.n_parallel > 1:         # one KV stream per sequence: a slot sees only itself
        params.n_seq_max = settings.n_parallel
        params.kv_unified = settings.kv_unified
    if settings.embeddings:             # pooled embeddings want a whole input in one ubatch
        params.embeddings = True
        params.n_ubatch = n_batch
        params.pooling_type = POOLING[settings.pooling]
    if hook is not None:
        params.cb_eval = hook.callback
        params.cb_eval_user_data = hook.user_data
    return params
