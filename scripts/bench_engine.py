#!/usr/bin/env python3
"""Tokens/s of moe-offload's completion path against plain llama-cpp-python, same model, one run.

    python scripts/bench_engine.py [-m MODEL.gguf] [-n 128] [-t 1] [--reps 5]

Configurations, each loaded once and run interleaved (round-robin, ``--reps`` rounds) so load
on a shared machine hits them alike; every run starts from an empty KV cache:
  llama-cpp-python   Llama(model, n_ctx).create_completion(prompt, max_tokens=N, temperature=0)
  ours, hook off     Engine(manage_residency=False).generate(...)   (what --no-residency runs)
  ours, residency    Engine() with the default residency config: routing hook + manager
  ours, capture      routing hook recording every token (trace record's mode), no manager

Two clocks per run: wall time, and this process's CPU time (``time.process_time``). On a busy
shared machine wall time mostly measures the neighbours; CPU time is what the code costs, so
the ratios are given on both. Printed per configuration (medians over the rounds):
  tok/s      completion tokens / wall seconds of the whole call (prefill included)
  cpu tok/s  completion tokens / CPU seconds of the whole call
  decode     decode-only tokens per CPU second: (N-1) / (cpu(N tokens) - cpu(1 token))
Without -m a synthetic qwen3moe model (16 layers x 32 experts, top-4, q8_0, ~210 MiB) is
written to the cache directory once.
"""
from __future__ import annotations

import argparse
import shlex
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

PROMPT = "Once upon a time, in a small town by the sea, there lived an old fisherman who"


def bench_model(directory: Path | None) -> Path:
    from gguf_tools.synth import SynthSpec
    from runtime.cache import cached_model

    spec = SynthSpec(arch="qwen3moe", layers=16, experts=32, top_k=4, embd=512, ff=256,
                     dtype="q8_0", seed=1, skew=1.0, name="moe-offload-bench")
    return cached_model(spec, directory)


class PlainLlama:
    name = "llama-cpp-python"

    def __init__(self, model: str, n_ctx: int, threads: int):
        import llama_cpp
        from runtime.native.llama_lib import bindings
        bindings()          # AMX-safe model defaults on a stock libllama (llama_lib._guard_amx)

        self.ll = llama_cpp.llama_cpp
        self.llm = llama_cpp.Llama(model_path=model, n_ctx=n_ctx, n_threads=threads,
                                   n_threads_batch=threads, verbose=False)

    def run(self, prompt: str, n: int) -> tuple[int, float, float]:
        self.llm.reset()
        t0, c0 = time.perf_counter(), time.process_time()
        out = self.llm.create_completion(prompt, max_tokens=n, temperature=0)
        return (out["usage"]["completion_tokens"], time.perf_counter() - t0,
                time.process_time() - c0)

    def close(self) -> None:
        self.llm.close()


class Ours:
    def __init__(self, name: str, model: str, n_ctx: int, threads: int, **kw):
        from runtime.engine.engine import Engine
        from runtime.engine.types import EngineSettings

        self.name = name
        self.engine = Engine(EngineSettings(model_path=model, n_ctx=n_ctx, n_threads=threads,
                                            n_threads_batch=threads, **kw), progress=False)
        if kw.get("capture_all_tokens"):
            from runtime.commands.trace_record import TraceRecorder

            self.engine.add_route_observer(TraceRecorder(_NullWriter()))

    def run(self, prompt: str, n: int) -> tuple[int, float, float]:
        from runtime.engine.sampling import SamplingParams

        self.engine.reset()
        t0, c0 = time.perf_counter(), time.process_time()
        last = None
        for chunk in self.engine.generate(prompt, SamplingParams(max_tokens=n, temperature=0)):
            last = chunk
        return last.usage.completion_tokens, time.perf_counter() - t0, time.process_time() - c0

    def close(self) -> None:
        self.engine.close()


class _NullWriter:
    """Stands in for TraceWriter: the capture cost without the file I/O."""

    rows_written = 0

    def append_batch(self, *, experts, **_):
        self.rows_written += experts.size


def main() -> int:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    ap.add_argument("-m", "--model", help="GGUF model (default: a synthetic bench model)")
    ap.add_argument("-n", "--predict", type=int, default=128, help="tokens per run")
    ap.add_argument("-c", "--ctx-size", type=int, default=1024)
    ap.add_argument("-t", "--threads", type=int, default=1, help="threads (all configs)")
    ap.add_argument("--reps", type=int, default=5, help="interleaved rounds")
    ap.add_argument("-p", "--prompt", default=PROMPT)
    args = ap.parse_args()
    model = args.model or str(bench_model(None))

    configs = [PlainLlama(model, args.ctx_size, args.threads),
               Ours("ours, hook off", model, args.ctx_size, args.threads,
                    manage_residency=False),
               Ours("ours, residency", model, args.ctx_size, args.threads),
               Ours("ours, capture", model, args.ctx_size, args.threads,
                    manage_residency=False, capture_all_tokens=True)]
    full: dict[str, list[tuple[int, float, float]]] = {c.name: [] for c in configs}
    one: dict[str, list[tuple[int, float, float]]] = {c.name: [] for c in configs}
    for c in configs:                      # warm-up: page the model in, build graphs
        c.run(args.prompt, 8)
    for _ in range(args.reps):
        for c in configs:
            full[c.name].append(c.run(args.prompt, args.predict))
            one[c.name].append(c.run(args.prompt, 1))
    for c in configs:
        c.close()
    for name, runs in full.items():
        if any(n != args.predict for n, _, _ in runs):
            print(f"warning: {name} generated {[n for n, _, _ in runs]} tokens", file=sys.stderr)

    med = statistics.median
    rows = {}
    for name in full:
        wall = med(n / w for n, w, _ in full[name])
        cpu = med(n / c for n, _, c in full[name])
        decode = (args.predict - 1) / max(1e-9, med(c for _, _, c in full[name]) -
                                          med(c for _, _, c in one[name]))
        rows[name] = (wall, cpu, decode)
    base_wall, base_cpu, _ = rows["llama-cpp-python"]
    print(f"$ python {' '.join(shlex.quote(a) for a in sys.argv)}")
    print(f"model {model}; prompt {len(args.prompt)} chars; {args.predict} tokens per run; "
          f"threads {args.threads}; {args.reps} interleaved rounds; medians")
    print(f"{'configuration':18s} {'tok/s':>8s} {'ratio':>6s} {'cpu tok/s':>10s} {'ratio':>6s} "
          f"{'decode':>8s}")
    for name, (wall, cpu, decode) in rows.items():
        print(f"{name:18s} {wall:8.1f} {wall / base_wall:6.3f} {cpu:10.1f} "
              f"{cpu / base_cpu:6.3f} {decode:8.1f}")
    off, cap, res = (rows[k][2] for k in ("ours, hook off", "ours, capture", "ours, residency"))
    print(f"decode cost (CPU) vs hook off: capture {100 * (off / cap - 1):+.1f}% time per token, "
          f"residency (hook + manager) {100 * (off / res - 1):+.1f}%")
    return 0


if __name__ == "__main__":
    sys.exit(main())
