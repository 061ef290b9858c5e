"""One benchmark configuration measured in this process (the worker side of ``bench``).

Tests, in llama-bench's manner: ``pp{P}`` (a P-token random prompt, prompt t/s), ``tg{N}``
(N tokens after a one-token prompt, generation t/s), both warm (after a warm-up run); and
``cold{C}``: the model file's pages dropped from the page cache (every mapping, then the file),
then a 16-token prompt and C generated tokens, t/s over the whole time. Every repetition uses a
fresh random prompt, so the engine's KV prefix reuse never applies.
"""
from __future__ import annotations

import os
import statistics
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import numpy as np

from runtime.ramtier.pager import drop_file_cache

COLD_PROMPT = 16     # tokens of the cold-start prompt


@dataclass(frozen=True)
class BenchConfig:
    """One row group of the table."""

    name: str                       # the table's "config" cell
    kind: str                       # "mmap" | "managed" | "static"
    budget_label: str               # the table's "expert budget" cell
    config: dict | None = None      # residency TOML as a dict (managed)
    config_path: str | None = None  # or a file (managed, --config)
    n_cpu_moe: int | None = None    # static: experts of the first N layers on the CPU
    env: dict = field(default_factory=dict)   # extra environment (e.g. tier options)

    def to_json(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class Sample:
    """One repetition of one test."""

    tokens: int                 # tokens the rate is over
    seconds: float
    accesses: int | None        # manager counters during the test (None: unmanaged)
    hits: int | None
    demand_miss_bytes: int | None
    read_bytes: int             # bytes this process read from storage (/proc/self/io)

    @property
    def tps(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


def _read_bytes() -> int:
    """Bytes this process has read from storage."""
    from runtime.bench.memwatch import process_read_bytes  # noqa: PLC0415

    return process_read_bytes(os.getpid())


class ConfigRunner:
    """Builds the engine for one config and runs the tests on it."""

    def __init__(self, model: str, cfg: BenchConfig, *, n_ctx: int, threads: int | None,
                 gpu_layers: int = 0, route_trace: str | None = None):
        from runtime.engine.engine import Engine, EngineSettings
        from runtime.engine.placement import cpu_moe_placement
        from runtime.residency.config import load_config, parse_config

        self.model, self.cfg, self.gpu_layers = model, cfg, gpu_layers
        config = None
        if cfg.kind == "managed":
            config = (load_config(cfg.config_path) if cfg.config_path
                      else parse_config(cfg.config or {}, source=cfg.name))
        settings = EngineSettings(model_path=model, n_ctx=n_ctx, n_threads=threads,
                                  manage_residency=cfg.kind == "managed", config=config,
                                  n_gpu_layers=-1 if cfg.kind == "static" else gpu_layers,
                                  route_trace=route_trace)
        placement = cpu_moe_placement(cfg.n_cpu_moe or 0) if cfg.kind == "static" else None
        self.engine = Engine(settings, progress=False, placement=placement)
        self.tier = next((p for p in self.engine.tiers
                          if type(p).__name__ == "RamTier"), None)
        self.rng = np.random.default_rng(1234)

    def close(self) -> None:
        self.engine.close()

    def backend(self) -> str:
        """"CPU", or "<GPU>+CPU" when layers are offloaded to a GPU."""
        from runtime.native import ggml_lib
        gpus = [d.name for d in ggml_lib.devices()
                if d.kind != ggml_lib.GGML_BACKEND_DEVICE_TYPE_CPU]
        on_gpu = self.cfg.kind == "static" or self.gpu_layers != 0
        return f"{gpus[0]}+CPU" if gpus and on_gpu else "CPU"

    def _prompt(self, n: int) -> list[int]:
        return self.rng.integers(0, self.engine.n_vocab, size=n).tolist()

    def _counters(self) -> tuple[int, int, int] | None:
        manager, devices = self.engine.manager, self.engine.residency_devices
        if manager is None or not devices:
            return None
        # the fastest managed tier (cuda:N, cpu-slots, then cpu): where a hit saves the most
        total = manager.snapshot().device(devices[0]).total
        return total.accesses, total.hits, total.demand_miss_bytes

    def _run(self, prompt: list[int], max_tokens: int, rate_of: str) -> Sample:
        from runtime.engine.sampling import SamplingParams

        return self._play(prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0),
                          (rate_of,))[0]

    def _play(self, prompt: list[int], params, rates: tuple[str, ...]) -> list[Sample]:
        """One generation; a Sample per rate ("prompt", "generation" or "total"), each with
        the whole generation's counters and reads."""
        before, io0 = self._counters(), _read_bytes()
        timings = None
        for chunk in self.engine.generate(prompt, params):
            if chunk.timings is not None:
                timings = chunk.timings
        after, io1 = self._counters(), _read_bytes()
        return [self._sample(timings, rate_of, before, after, io1 - io0) for rate_of in rates]

    def _sample(self, timings, rate_of: str, before, after, read: int) -> Sample:
        if rate_of == "prompt":
            tokens, seconds = timings.prompt_tokens, timings.prompt_s
        elif rate_of == "generation":
            tokens, seconds = timings.completion_tokens, timings.generation_s
        else:
            tokens, seconds = timings.completion_tokens, timings.prompt_s + timings.generation_s
        delta = None if before is None else [a - b for a, b in zip(after, before)]
        return Sample(tokens, seconds, *(delta if delta else (None, None, None)), read)

    def warm_up(self) -> None:
        self._run(self._prompt(8), 4, "generation")

    def pp(self, p: int) -> Sample:
        return self._run(self._prompt(p), 1, "prompt")

    def tg(self, n: int) -> Sample:
        return self._run(self._prompt(1), n, "generation")

    def cold(self, n: int) -> Sample:
        drop_file_cache(self.model)
        return self._run(self._prompt(COLD_PROMPT), n, "total")

    def play_trace(self, *, cold: bool = False) -> list[Sample]:
        """The imposed trace played from its first position: its prompt, then every decode
        row. (prompt, generation) samples, or the whole play's when ``cold`` (page cache
        dropped first)."""
        from runtime.engine.hook.imposed_routing import imposed_request
        from runtime.engine.sampling import SamplingParams

        if cold:
            drop_file_cache(self.model)
        self.engine.reset()
        prompt, params = imposed_request(self.engine, None, SamplingParams(temperature=0.0),
                                         _WholeTrace())
        return self._play(prompt, params, ("total",) if cold else ("prompt", "generation"))


class _WholeTrace:
    """Arguments without -p and -n: the trace's own prompt and every decode row."""

    predict_given = False


def summarize(samples: list[Sample]) -> dict:
    """Mean/sd of t/s, hit %, demand-miss and read MiB per token over repetitions."""
    rates = [s.tps for s in samples]
    tokens = sum(s.tokens for s in samples) or 1
    managed = samples[0].accesses is not None
    accesses = sum(s.accesses or 0 for s in samples)
    return {
        "tps": statistics.fmean(rates),
        "tps_sd": statistics.stdev(rates) if len(rates) > 1 else 0.0,
        "samples_tps": rates,
        "seconds": statistics.fmean(s.seconds for s in samples),
        "tokens": samples[0].tokens,
        "hit_pct": (100.0 * sum(s.hits or 0 for s in samples) / accesses)
        if managed and accesses else None,
        "demand_miss_mib_per_tok": (sum(s.demand_miss_bytes or 0 for s in samples) / tokens / 2**20)
        if managed else None,
        "read_mib_per_tok": sum(s.read_bytes for s in samples) / tokens / 2**20,
    }


def run_config(model: str, cfg: BenchConfig, *, p: int, n: int, reps: int, cold: int,
               threads: int | None, step: Callable[[str], None], gpu_layers: int = 0,
               route_trace: str | None = None) -> dict:
    """Every test of one config: ``{"backend", "tests": {name: summary}, "tier": ...}``.
    With ``route_trace`` the tests are plays of the trace instead (``trace_tests``)."""
    n_ctx = max(p, COLD_PROMPT, 8) + max(n, cold, 4) + 16
    if route_trace is not None:     # a play needs the trace's positions (refused past n_ctx)
        n_ctx = 2048
    runner = ConfigRunner(model, cfg, n_ctx=n_ctx, threads=threads,
                          gpu_layers=gpu_layers, route_trace=route_trace)
    try:
        out: dict = {"backend": runner.backend(), "tests": {}}
        if route_trace is not None:
            out["tests"] = trace_tests(runner, reps, cold > 0, step)
            out["imposed"] = runner.engine.imposed.note()
        else:
            step("warm-up")
            runner.warm_up()
            plan = [(f"pp{p}", lambda: runner.pp(p)) if p > 0 else None,
                    (f"tg{n}", lambda: runner.tg(n)) if n > 0 else None,
                    (f"cold{cold}", lambda: runner.cold(cold)) if cold > 0 else None]
            for name, fn in filter(None, plan):
                samples = []
                for rep in range(reps):
                    step(f"{name} {rep + 1}/{reps}")
                    samples.append(fn())
                out["tests"][name] = summarize(samples)
        if runner.tier is not None:
            out["tier"] = {"stats": asdict(runner.tier.stats()),
                           "truth": runner.tier.truth().to_dict(),
                           "notices": list(runner.tier.notices)}
        out["pid_peak_rss_bytes"] = _peak_rss()
        return out
    finally:
        runner.close()


def trace_tests(runner: ConfigRunner, reps: int, cold: bool,
                step: Callable[[str], None]) -> dict:
    """Plays of the imposed trace: ``pp{P}@trace`` and ``tg{D}@trace`` (its prompt and its
    decode rows, warm: after one play), and ``cold{D}@trace`` (a play after a page-cache drop,
    t/s over the whole time)."""
    routing = runner.engine.imposed
    tests: dict[str, list[Sample]] = {}
    if cold:
        step("cold play")
        tests[f"cold{routing.max_new_tokens}@trace"] = runner.play_trace(cold=True)
    step("warm-up play")
    runner.play_trace()
    for rep in range(reps):
        step(f"trace play {rep + 1}/{reps}")
        prompt, generation = runner.play_trace()
        tests.setdefault(f"pp{routing.n_prompt}@trace", []).append(prompt)
        tests.setdefault(f"tg{routing.max_new_tokens}@trace", []).append(generation)
    return {name: summarize(samples) for name, samples in tests.items()}


def _peak_rss() -> int:
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

