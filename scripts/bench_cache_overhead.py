#!/usr/bin/env python3
"""What the device cache's machinery costs per token and per MoE layer, on the CPU.

    python scripts/bench_cache_overhead.py [-n 128] [--reps 3] [-t 1] [--device cpu-slots]
                                           [-ngl 0] [--eviction lru]

The model is deep and narrow on purpose (Qwen3-30B-A3B's 48 layers, 128 experts, top-8, but
widths 64/32, q8_0; written once to the cache directory), so the expert matmuls cost almost
nothing and what is left is the overhead a GPU run pays on every token: the patched graph's
extra nodes (tables, slot path, cold ids), the routing hook (Python calls per layer), the
manager and the cache's table updates and copies. Configurations, each loaded once and run
interleaved (``--reps`` rounds, medians), greedy decode from an empty KV cache:
  experts on CPU   the cache's placement without a cache (experts in host memory, unrepacked)
  cache 100%       cpu-slots with room for every expert: after the prompt every access hits
  cache 25% EV     cpu-slots at 25% of the expert bytes, admit every miss, eviction EV
                   (--eviction: lru, or e.g. next-visit)
``--device cuda:0`` (or vulkan:0) with ``-ngl 99`` measures the same on a GPU (the patched
library from $LLAMA_CPP_LIB_PATH, else the newest build of that backend): the experts stay in
host memory, the cache's slots live on the device. Printed: decode ms/token (wall, and this
process's CPU time per decode token), the difference to "experts on CPU" per token and per MoE
layer on both clocks, and whether the greedy tokens equal the reference
(they must: same bytes; on a GPU the cold and hot kernels differ, so the line says so).
"""
from __future__ import annotations

import argparse
import shlex
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

PROMPT_TOKENS = list(range(10, 42))


def _model() -> Path:
    from gguf_tools.synth import SynthSpec
    from runtime.cache import cached_model

    spec = SynthSpec(arch="qwen3moe", layers=48, experts=128, top_k=8, embd=64, ff=32,
                     dtype="q8_0", seed=0, skew=1.0)
    return cached_model(spec)


def _engines(model: Path, lib_dir: str, threads: int, n_gen: int, device: str, ngl: int,
             eviction: str = "lru"):
    from gguf_tools.facts import read_model_facts
    from runtime.engine.engine import Engine, EngineSettings
    from runtime.engine.placement import cpu_moe_placement
    from runtime.residency.config import parse_config

    total = read_model_facts(model).total_expert_bytes
    policy = {"phase_specific": False,
              "decode": {"admission": "always", "prefetch": "none", "eviction": eviction}}

    def settings(config=None, **kw):
        return EngineSettings(model_path=str(model), n_ctx=len(PROMPT_TOKENS) + n_gen + 16,
                              n_threads=threads, n_threads_batch=threads, n_gpu_layers=ngl,
                              manage_residency=config is not None, config=config,
                              lib_dir=lib_dir, **kw)

    def cache(share: float):
        return parse_config({"devices": {device: f"{int(total * share)}B"},
                             "policy": policy}, source="bench")

    return {
        "experts on CPU": Engine(settings(repack=False), progress=False,
                                 placement=cpu_moe_placement(None)),
        "cache 100%": Engine(settings(cache(1.05)), progress=False),
        f"cache 25% {eviction}": Engine(settings(cache(0.25)), progress=False),
    }


def _generate(engine, n_gen: int):
    from runtime.engine.sampling import SamplingParams

    engine.reset()                                   # from an empty KV cache
    c0 = time.process_time()
    chunks = list(engine.generate(PROMPT_TOKENS, SamplingParams(max_tokens=n_gen,
                                                                temperature=0.0)))
    return chunks, time.process_time() - c0


def _decode(engine, n_gen: int) -> tuple[float, float, list[int]]:
    """Wall seconds per decode token (the prompt's time left out), CPU seconds per decode
    token ((cpu(n_gen tokens) - cpu(1 token)) / (n_gen - 1): this process, every thread; on a
    shared machine wall time also measures the neighbours) and the tokens."""
    chunks, cpu = _generate(engine, n_gen)
    _, cpu_one = _generate(engine, 1)
    timings = chunks[-1].timings
    tokens = [c.token for c in chunks if c.token is not None]
    return (timings.generation_s / max(timings.completion_tokens, 1),
            (cpu - cpu_one) / max(n_gen - 1, 1), tokens)


def main() -> int:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-n", "--n-gen", type=int, default=128)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("-t", "--threads", type=int, default=1)
    parser.add_argument("--device", default="cpu-slots",
                        help="the cache device: cpu-slots, cuda:N, vulkan:N")
    parser.add_argument("-ngl", "--gpu-layers", type=int, default=0,
                        help="layers on the GPU (99: all dense weights; experts stay in host "
                             "memory)")
    parser.add_argument("--eviction", default="lru",
                        help="the 25%% cache's decode eviction policy (lru, next-visit, ...)")
    args = parser.parse_args()
    import os

    from gguf_tools.facts import read_model_facts
    from runtime.native.build import BuildRequest, build, find_build

    backend = args.device.split(":")[0] if args.device != "cpu-slots" else "cpu"
    lib_dir = os.environ.get("LLAMA_CPP_LIB_PATH")
    if lib_dir is None:
        info = find_build(backend) or build(BuildRequest(backend=backend))
        lib_dir = info.lib_dir
    model = _model()
    n_moe = len(read_model_facts(model).moe_layers)
    engines = _engines(model, lib_dir, args.threads, args.n_gen, args.device,
                       args.gpu_layers, args.eviction)
    times: dict[str, list[float]] = {name: [] for name in engines}
    cpu_times: dict[str, list[float]] = {name: [] for name in engines}
    tokens: dict[str, list[int]] = {}
    started = time.perf_counter()
    for _ in range(args.reps):
        for name, engine in engines.items():
            seconds, cpu_seconds, toks = _decode(engine, args.n_gen)
            times[name].append(seconds)
            cpu_times[name].append(cpu_seconds)
            tokens.setdefault(name, toks)
    for engine in engines.values():
        engine.close()
    base = statistics.median(times["experts on CPU"])
    cpu_base = statistics.median(cpu_times["experts on CPU"])
    ref = tokens["experts on CPU"]
    print(f"model: {model.name} ({n_moe} MoE layers); {args.n_gen} decode tokens, "
          f"{args.reps} rounds, -t {args.threads}, device {args.device}, -ngl "
          f"{args.gpu_layers}; {time.perf_counter() - started:.0f} s")
    print()
    print("| configuration | decode ms/token | + ms/token | + µs per MoE layer | CPU ms/token "
          "| + CPU µs per MoE layer | greedy = ref |")
    print("|---|---:|---:|---:|---:|---:|---|")
    for name, samples in times.items():
        t, c = statistics.median(samples), statistics.median(cpu_times[name])
        print(f"| {name} | {t * 1e3:.2f} | {(t - base) * 1e3:+.2f} | "
              f"{(t - base) * 1e6 / n_moe:+.0f} | {c * 1e3:.2f} | "
              f"{(c - cpu_base) * 1e6 / n_moe:+.0f} | {'yes' if tokens[name] == ref else 'NO'} |")
    print()
    print("command: python scripts/bench_cache_overhead.py "
          + " ".join(shlex.quote(a) for a in sys.argv[1:]))
    same = all(t == ref for t in tokens.values())
    if not same and args.device != "cpu-slots":
        print("(on a GPU the slot path's kernels are not the CPU's: greedy tokens may differ "
              "in the last bits; parity is checked by runtime.bench.cache_check)")
        return 0
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
