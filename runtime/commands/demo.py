"""``moe-offload demo``: the main job on the built-in default model, in one command.

1. writes the default synthetic MoE model into the cache directory (once; keyed by its spec),
2. prints its expert layout (``moe-offload inspect``'s table),
3. generates a completion through the offload runtime with the expert cache budget set to a
   fraction of the model's expert bytes, streaming the text, and closes with the telemetry
   line (prompt t/s, generation t/s, expert hit rate) and the manager's per-phase counters,
4. says that the weights are random (the text is noise; the counters are the point) and what
   to run next.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from runtime.cache import cache_dir, cached_model
from runtime.errors import UserError

DEMO_PROMPT = "Once upon a time, in a small town by the sea,"


def default_spec():
    """The built-in default model: 8 layers x 32 experts (top-4), q8_0, skewed routing."""
    from gguf_tools.synth import SynthSpec  # noqa: PLC0415

    return SynthSpec(arch="qwen3moe", layers=8, experts=32, top_k=4, embd=256, ff=128,
                     dtype="q8_0", seed=0, skew=1.0, name="moe-offload-demo")


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "demo", help="write the default model, show its experts, generate with the offload "
                     "runtime", formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        description=__doc__.split("\n\n")[1] if __doc__ else None)
    p.add_argument("--model-dir", default=str(cache_dir("models")), metavar="DIR",
                   help="where the default model is cached")
    p.add_argument("-p", "--prompt", default=DEMO_PROMPT, help="prompt text")
    p.add_argument("-n", "--predict", type=int, default=64, metavar="N",
                   help="tokens to generate")
    p.add_argument("--capacity", default="25%", metavar="PCT",
                   help="expert cache budget: a percentage of the model's expert bytes, "
                        "passed on as --devices.cpu in bytes (--devices.cpu N%% itself "
                        "would mean N%% of the free RAM)")
    p.add_argument("-s", "--seed", type=int, default=0, help="sampling seed")
    p.add_argument("-t", "--threads", type=int, default=None, metavar="N", help="CPU threads")
    p.set_defaults(func=run)


def _capacity_bytes(text: str, total_expert_bytes: int) -> int:
    from runtime.units import parse_percent  # noqa: PLC0415

    try:
        share = parse_percent(text)
    except ValueError as exc:
        raise UserError(f"--capacity: {exc}") from None
    if share is None or not 0 < share <= 1:
        raise UserError(f"--capacity: {text!r} must be a percentage in (0%, 100%]")
    return max(1, int(total_expert_bytes * share))


def run(args: argparse.Namespace) -> int:
    from runtime.commands.inspect import format_table  # noqa: PLC0415
    from gguf_tools.expert_index import ExpertIndex  # noqa: PLC0415
    from runtime.engine.engine import Engine  # noqa: PLC0415
    from runtime.engine.sampling import SamplingParams  # noqa: PLC0415
    from runtime.engine.types import EngineSettings  # noqa: PLC0415
    from runtime.residency.config import load_config  # noqa: PLC0415
    from runtime.residency.types import Phase  # noqa: PLC0415
    from runtime.units import format_size  # noqa: PLC0415

    if args.predict < 1:
        raise UserError(f"--predict: {args.predict} must be >= 1")
    path = cached_model(default_spec(), Path(args.model_dir))
    index = ExpertIndex.open(path)
    print(format_table(index))
    capacity = _capacity_bytes(args.capacity, index.facts.total_expert_bytes)
    device = "cpu"
    config = load_config(None, overrides={f"devices.{device}": str(capacity)})
    print(f"\n$ moe-offload complete -m {path} -p {args.prompt!r} -n {args.predict} "
          f"-s {args.seed} --devices.{device} {capacity}\n"
          f"# --devices.{device} {capacity}: a budget of {capacity:,} bytes, {args.capacity} of "
          f"the model's {format_size(index.facts.total_expert_bytes)} of experts (a budget "
          f"given as N% is N% of the free RAM)\n")
    sys.stdout.flush()
    settings = EngineSettings(model_path=str(path), n_ctx=2048, n_threads=args.threads,
                              seed=args.seed, config=config)
    params = SamplingParams(max_tokens=args.predict, seed=args.seed)
    last = None
    with Engine(settings) as engine:
        sys.stdout.write(args.prompt)
        for chunk in engine.generate(args.prompt, params):
            sys.stdout.write(chunk.text)
            sys.stdout.flush()
            last = chunk
        snap = engine.manager.snapshot().device(device)
    print("\n")
    print(last.timings.summary())
    for phase in (Phase.PREFILL, Phase.DECODE):
        c = snap.phase(phase)
        rate = f"{100 * c.hits / c.accesses:.1f}%" if c.accesses else "n/a"
        print(f"  {phase.name.lower():8s} accesses {c.accesses:6d}  hits {c.hits:6d} ({rate})  "
              f"misses {c.misses:5d}  demand-miss {format_size(c.demand_miss_bytes)}  "
              f"evictions {c.evictions}")
    print(f"  {device} tier: {format_size(snap.resident_bytes)} resident of "
          f"{format_size(snap.capacity_bytes or 0)} ({snap.resident_experts} experts)")
    print(NEXT_STEPS)
    return 0


NEXT_STEPS = """
The demo model's weights are random, so its text is noise: what it shows is the expert
traffic above (hits, misses, bytes moved under a budget of part of the experts).
Next:
  moe-offload complete -hf ggml-org/Qwen3-30B-A3B-GGUF:Q4_K_M -p "Hello" --auto
                                      # a real model (downloaded once; README: run a real model)
  moe-offload serve -m MODEL.gguf --auto   # an OpenAI-compatible server and a chat page
  moe-offload bench                        # mmap vs the managed tiers, on this machine"""
