"""Benchmark drivers that run the whole engine: the offload benchmark (``moe-offload bench``:
offload.py, run.py, worker.py, model.py) and the device cache's side-by-side check
(cache_check.py, for scripts/gpu_check.sh). They sit above runtime.engine and the tiers, which
never import them."""
