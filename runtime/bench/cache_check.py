"""Side-by-side run of the device cache through the Engine, for scripts/gpu_check.sh:
speed, hit rates per phase, copies, and whether the greedy tokens equal a plain run.

    python -m runtime.bench.cache_check MODEL --config lru.toml --config phase.toml \
        [-p 512] [-n 128]

Rows: "plain" (residency off, llama.cpp's own placement with -ngl: on a GPU with room, every
expert on the GPU: the upper bound); "experts on CPU" (the cache's placement without the cache:
every routed expert in host memory, not repacked, dense layers per -ngl: the reference); then
one row per residency TOML (its cuda:N / vulkan:N / cpu-slots device served by the device cache).
Every run is greedy over the same random prompt; "greedy = ref" compares the generated tokens
with the reference. With cpu-slots every expert is computed by the same CPU kernel on the same
bytes either way, so the tokens must be equal (exit 1 if not); on a GPU the resident experts run
on GPU kernels, so a difference there is reported, not failed. Every run loads the same
libllama: $LLAMA_CPP_LIB_PATH, else the patched build for the configs' cache devices.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np


def _run(model: str, config, ngl: int, prompt: list[int], n_gen: int, threads: int | None,
         lib_dir: str | None, *, experts_on_cpu: bool = False):
    from runtime.engine.engine import Engine, EngineSettings, SamplingParams  # noqa: PLC0415
    from runtime.engine.placement import cpu_moe_placement  # noqa: PLC0415

    settings = EngineSettings(model_path=model, n_ctx=len(prompt) + n_gen + 16, n_threads=threads,
                              n_gpu_layers=ngl, n_batch=512, n_ubatch=512,
                              manage_residency=config is not None, config=config,
                              lib_dir=lib_dir, repack=False if experts_on_cpu else None)
    engine = Engine(settings, progress=False,
                    placement=cpu_moe_placement(None) if experts_on_cpu else None)
    try:
        started = time.perf_counter()
        chunks = list(engine.generate(prompt, SamplingParams(max_tokens=n_gen, temperature=0.0)))
        wall = time.perf_counter() - started
        timings = chunks[-1].timings
        row = {"tokens": [c.token for c in chunks if c.token is not None],
               "pp": timings.prompt_tps if timings else 0.0,
               "tg": timings.generation_tps if timings else 0.0, "wall": wall}
        caches = next((a for a in engine.tiers if hasattr(a, "caches")), None)
        if caches is not None and caches.caches:
            cache = caches.caches[0]
            phases = engine.manager.snapshot().to_dict()["devices"][cache.device]["phases"]
            pools = range(cache.store.n_pool)
            row.update(device=cache.device, copies=cache.copies,
                       slots=sum(cache.store.pool_info(p)[0] for p in pools),
                       slot_bytes=cache.store.allocated_bytes())
            for phase in ("prefill", "decode"):
                acc = phases[phase]["accesses"]
                row[f"{phase}_hit"] = 100.0 * phases[phase]["hits"] / acc if acc else None
        return row
    finally:
        engine.close()


def _library(configs) -> str:
    """One libllama for every run (a process loads one): the environment's, else the patched
    build serving the configs' cache devices (runtime.native.lib_dir_for)."""
    from runtime.native import lib_dir_for  # noqa: PLC0415
    from runtime.residency.config import is_cache_device  # noqa: PLC0415

    return lib_dir_for({b.device for c in configs for b in c.devices
                        if is_cache_device(b.device)})


def main(argv: list[str] | None = None) -> int:
    from runtime.errors import UserError  # noqa: PLC0415

    try:
        return _main(argv)
    except UserError as exc:
        print(f"python -m runtime.bench.cache_check: error: {exc}", file=sys.stderr)
        return 2


def _main(argv: list[str] | None) -> int:
    from runtime.residency.config import load_config  # noqa: PLC0415

    parser = argparse.ArgumentParser(allow_abbrev=False, prog="python -m runtime.bench.cache_check",
                                     description=__doc__)
    parser.add_argument("model")
    parser.add_argument("--config", action="append", default=[], metavar="TOML")
    parser.add_argument("-p", "--n-prompt", type=int, default=512)
    parser.add_argument("-n", "--n-gen", type=int, default=128)
    parser.add_argument("-ngl", "--gpu-layers", type=int, default=-1)
    parser.add_argument("-t", "--threads", type=int, default=None)
    args = parser.parse_args(argv)
    rows = []
    # token ids below 1000 exist in every vocabulary we run (synthetic ones have ~2k)
    prompt = np.random.default_rng(1234).integers(10, 1000, size=args.n_prompt).tolist()
    configs = [load_config(c) for c in args.config]
    lib_dir = _library(configs)
    runs = [("plain", None, False), ("experts on CPU", None, True)]
    runs += [(Path(c).stem, cfg, False) for c, cfg in zip(args.config, configs)]
    for name, config, on_cpu in runs:
        row = _run(args.model, config, args.gpu_layers, prompt, args.n_gen, args.threads,
                   lib_dir, experts_on_cpu=on_cpu)
        row["name"] = name
        rows.append(row)
        print(f"check: {name} done", file=sys.stderr)
    ref = rows[1]["tokens"]
    print("| config | device | slots | pp t/s | tg t/s | prefill hit % | decode hit % | copies "
          "| greedy = ref |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |")
    fmt = lambda v: "-" if v is None else f"{v:.1f}"  # noqa: E731
    for r in rows:
        slots = f"{r['slots']} ({r['slot_bytes'] / 2**20:.0f} MiB)" if "slots" in r else "-"
        print(f"| {r['name']} | {r.get('device', '-')} | {slots} | {r['pp']:.1f} | {r['tg']:.1f} "
              f"| {fmt(r.get('prefill_hit'))} | {fmt(r.get('decode_hit'))} "
              f"| {r.get('copies', '-')} | {'yes' if r['tokens'] == ref else 'NO'} |")
    mismatched = [r["name"] for r in rows if r.get("device") == "cpu-slots" and r["tokens"] != ref]
    return 1 if mismatched else 0


if __name__ == "__main__":
    sys.exit(main())
