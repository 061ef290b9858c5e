"""``moe-offload synth OUT.gguf``: write a random-weight MoE model llama.cpp can run.

    moe-offload synth OUT.gguf [--arch qwen3moe|llama|gpt-oss|deepseek2|olmoe] [--layers N]
        [--experts E] [--top-k K] [--embd D] [--ff F] [--dtype f32|f16|q8_0|q4_0|q4_k_m|...]
        [--seed S] [--skew Z] [--dense-layers N] [--shared-experts N] [--gate-up-merged]

Streams to ``OUT.gguf`` through a temporary file that is renamed at the end, so an interrupted
write leaves no partial OUT. Impossible shapes are refused with one line before anything is
written.
"""
from __future__ import annotations

import argparse
from pathlib import Path

from dataclasses import fields
from types import SimpleNamespace

from gguf_tools.synth_spec import ARCHS, DTYPES, SHARED_EXPERT_ARCHS, SynthSpec, SynthSpecError
from runtime.errors import UserError
from runtime.units import format_size

# SynthSpec's defaults without making one (that would load the writer and gguf-py)
_DEFAULTS = SimpleNamespace(**{f.name: f.default for f in fields(SynthSpec)})


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "synth", help="write a random-weight MoE GGUF model (for tests and benchmarks)",
        description="Write a random-weight mixture-of-experts GGUF model that llama.cpp loads "
                    "and runs, from a few MB up to full real shapes (streamed, bounded RAM).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("out", metavar="OUT.gguf", help="file to write (replaced atomically)")
    parser.add_argument("--arch", choices=sorted(ARCHS), default=_DEFAULTS.arch,
                        help="llama.cpp architecture")
    parser.add_argument("--layers", type=int, default=_DEFAULTS.layers, help="transformer blocks")
    parser.add_argument("--experts", type=int, default=_DEFAULTS.experts,
                        help="routed experts per layer")
    parser.add_argument("--top-k", type=int, default=_DEFAULTS.top_k,
                        help="experts used per token")
    parser.add_argument("--embd", type=int, default=_DEFAULTS.embd, help="hidden size (n_embd)")
    parser.add_argument("--ff", type=int, default=_DEFAULTS.ff,
                        help="expert feed-forward length (n_ff_exp)")
    parser.add_argument("--heads", type=int, default=_DEFAULTS.heads, help="attention heads")
    parser.add_argument("--heads-kv", type=int, default=_DEFAULTS.heads_kv, help="KV heads")
    parser.add_argument("--head-dim", type=int, default=_DEFAULTS.head_dim,
                        help="head dimension; 0 = embd / heads")
    parser.add_argument("--dtype", choices=DTYPES, default=_DEFAULTS.dtype,
                        help="weight type (q4_k_m: Q4_K gate/up, Q6_K or Q4_K down per layer)")
    parser.add_argument("--seed", type=int, default=_DEFAULTS.seed,
                        help="RNG seed; the same arguments give the same bytes")
    parser.add_argument("--skew", type=float, default=_DEFAULTS.skew,
                        help="Zipf exponent of per-layer expert popularity; 0 = even")
    parser.add_argument("--context-length", type=int, default=_DEFAULTS.context_length,
                        help="trained context length written to the file")
    parser.add_argument("--expert-scales", action="store_true",
                        help="add per-expert ffn_*_exps.scale tensors")
    parser.add_argument("--dense-layers", type=int, default=0,
                        help="leading dense (non-MoE) layers (deepseek2)")
    parser.add_argument("--shared-experts", type=int, default=None,
                        help="shared experts per MoE layer (deepseek2; default 1 there, else 0)")
    parser.add_argument("--gate-up-merged", action="store_true",
                        help="write one ffn_gate_up_exps tensor instead of gate + up (deepseek2)")
    parser.add_argument("--quiet", action="store_true", help="no progress bar or summary")
    parser.set_defaults(func=run)


def spec_from_args(args: argparse.Namespace) -> SynthSpec:
    """The ``SynthSpec`` the arguments describe; ``UserError`` for an impossible shape."""
    shared = args.shared_experts
    if shared is None:
        shared = 1 if args.arch in SHARED_EXPERT_ARCHS else 0
    try:
        return SynthSpec(arch=args.arch, layers=args.layers, experts=args.experts,
                         top_k=args.top_k, embd=args.embd, ff=args.ff, dtype=args.dtype,
                         seed=args.seed, skew=args.skew, heads=args.heads,
                         heads_kv=args.heads_kv, head_dim=args.head_dim,
                         context_length=args.context_length, expert_scales=args.expert_scales,
                         dense_layers=args.dense_layers, shared_experts=shared,
                         gate_up_merged=args.gate_up_merged)
    except SynthSpecError as exc:
        raise UserError(f"{args.out}: cannot write this model: {exc}") from None


def run(args: argparse.Namespace) -> int:
    from tqdm import tqdm  # noqa: PLC0415

    from gguf_tools.synth import planned_data_bytes, write_synthetic_model  # noqa: PLC0415

    spec = spec_from_args(args)
    out = Path(args.out)
    if out.is_dir():
        raise UserError(f"{out}: is a directory")
    if not out.parent.is_dir():
        raise UserError(f"{out}: directory {out.parent} does not exist")
    total = planned_data_bytes(spec)
    # delay: a bar only shows when the write takes more than a couple of seconds
    with tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, delay=2.0,
              desc=out.name, disable=args.quiet, leave=False) as bar:
        try:
            write_synthetic_model(out, spec, progress=bar.update)
        except OSError as exc:
            raise UserError(f"{out}: write failed ({exc.strerror or exc})") from None
    if not args.quiet:
        print(f"wrote {out}: {spec.arch}, {spec.layers} layers, {spec.experts} experts "
              f"(top-{spec.top_k}), embd {spec.embd}, expert ff {spec.ff}, {spec.dtype}, "
              f"{format_size(out.stat().st_size)}")
    return 0
