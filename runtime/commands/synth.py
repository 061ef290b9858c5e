"""``moe-offload synth OUT.gguf``: write a random-weight MoE model llama.cpp can run.

    moe-offload synth OUT.gguf [--arch qwen3moe|llama|gpt-oss|deepseek2|olmoe] [--layers N]
        [--experts E] [--top-k K] [--embd D] [--ff F] [--dtype f32|f16|q8_0|q4_0|q4_k_m|...]
        [--seed S] [--skew Z] [--dense-layers N] [--shared-experts N] [--gate-up-merged]
    moe-offload synth --preset qwen3-30b-a3b [--top-k 6] [--dtype q8_0|q4_k_m] OUT.gguf
    moe-offload synth --list-presets

Streams to ``OUT.gguf`` through a temporary file that is renamed at the end, so an interrupted
write leaves no partial OUT. Impossible shapes are refused with one line before anything is
written. A preset (gguf_tools/presets.py) is a published model's shape and types; any shape flag
given with it overrides that one value.
"""
from __future__ import annotations

import argparse
from pathlib import Path

from dataclasses import fields
from types import SimpleNamespace

from gguf_tools.presets import DEFAULT_DTYPE, PRESET_DTYPES, PRESETS, get_preset
from gguf_tools.synth_spec import ARCHS, DTYPES, SHARED_EXPERT_ARCHS, SynthSpec, SynthSpecError
from runtime.errors import UserError
from runtime.units import format_size

# SynthSpec's defaults without making one (that would load the writer and gguf-py)
_DEFAULTS = SimpleNamespace(**{f.name: f.default for f in fields(SynthSpec)})
# flag dest -> SynthSpec field, for the flags that default to None ("not given"): a given one
# overrides the preset's value (or SynthSpec's default without a preset)
_SHAPE_FLAGS = ("layers", "experts", "top_k", "embd", "ff", "heads", "heads_kv", "head_dim",
                "dtype", "seed", "skew", "context_length", "dense_layers", "shared_experts",
                "n_vocab")

_DESCRIPTION = """\
Write a random-weight mixture-of-experts GGUF model that llama.cpp loads and runs, from a few MB
up to full real shapes (streamed, bounded RAM).

--preset NAME writes a published model's shape: its tensors' names, shapes and types as
llama-quantize gives them at --dtype q8_0 or q4_k_m (default q4_k_m; gpt-oss keeps its experts
in MXFP4, as shipped), its hyper-parameters and its vocabulary size (padded with unused tokens),
so `moe-offload inspect` shows the real file's bytes per expert and layer. Any shape flag given
with --preset overrides that value only (--top-k 6; --layers 4 writes a 4-layer model of the same
widths, whose Q4_K_M per-layer mix is then a 4-layer model's); --arch cannot be combined with
it. --list-presets prints every preset and its file size per dtype (nothing written)."""


def register(subparsers: argparse._SubParsersAction) -> None:
    d = _DEFAULTS
    parser = subparsers.add_parser(
        "synth", help="write a random-weight MoE GGUF model (for tests and benchmarks)",
        description=_DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", metavar="OUT.gguf", nargs="?",
                        help="file to write (replaced atomically)")
    parser.add_argument("--preset", metavar="NAME",
                        help=f"a published model's shape: {', '.join(PRESETS)}")
    parser.add_argument("--list-presets", action="store_true",
                        help="print the presets and their file sizes, write nothing")
    parser.add_argument("--arch", choices=sorted(ARCHS), default=None,
                        help=f"llama.cpp architecture (default {d.arch}; not with --preset)")
    parser.add_argument("--layers", type=int, help=f"transformer blocks (default {d.layers})")
    parser.add_argument("--experts", type=int,
                        help=f"routed experts per layer (default {d.experts})")
    parser.add_argument("--top-k", type=int, help=f"experts used per token (default {d.top_k})")
    parser.add_argument("--embd", type=int, help=f"hidden size, n_embd (default {d.embd})")
    parser.add_argument("--ff", type=int,
                        help=f"expert feed-forward length, n_ff_exp (default {d.ff})")
    parser.add_argument("--heads", type=int, help=f"attention heads (default {d.heads})")
    parser.add_argument("--heads-kv", type=int, help=f"KV heads (default {d.heads_kv})")
    parser.add_argument("--head-dim", type=int,
                        help="head dimension; 0 = embd / heads (default 0)")
    parser.add_argument("--dtype", choices=DTYPES,
                        help=f"weight type (default {d.dtype}; with --preset {DEFAULT_DTYPE}, "
                             f"one of {', '.join(PRESET_DTYPES)}); q4_k_m: Q4_K gate/up, "
                             "Q6_K or Q4_K down per layer")
    parser.add_argument("--seed", type=int,
                        help=f"RNG seed; the same arguments give the same bytes (default {d.seed})")
    parser.add_argument("--skew", type=float,
                        help=f"Zipf exponent of per-layer expert popularity; 0 = even "
                             f"(default {d.skew})")
    parser.add_argument("--context-length", type=int,
                        help=f"trained context length written to the file (default "
                             f"{d.context_length})")
    parser.add_argument("--n-vocab", type=int,
                        help="token rows of token_embd/output: the synthetic vocabulary padded "
                             "with unused tokens; 0 = the synthetic 1,621 (default 0, with "
                             "--preset the model's)")
    parser.add_argument("--expert-scales", action="store_true",
                        help="add per-expert ffn_*_exps.scale tensors")
    parser.add_argument("--dense-layers", type=int,
                        help="leading dense (non-MoE) layers (deepseek2; default 0)")
    parser.add_argument("--shared-experts", type=int,
                        help="shared experts per MoE layer (deepseek2; default 1 there, else 0)")
    parser.add_argument("--gate-up-merged", action="store_true",
                        help="write one ffn_gate_up_exps tensor instead of gate + up (deepseek2)")
    parser.add_argument("--quiet", action="store_true", help="no progress bar or summary")
    parser.set_defaults(func=run)


def spec_from_args(args: argparse.Namespace) -> SynthSpec:
    """The ``SynthSpec`` the arguments describe; ``UserError`` for an impossible shape."""
    where = f"{args.out}: cannot write this model" if args.out else "synth"
    given = {name: getattr(args, name) for name in _SHAPE_FLAGS if getattr(args, name) is not None}
    for flag in ("expert_scales", "gate_up_merged"):
        if getattr(args, flag):
            given[flag] = True
    if args.preset is not None:
        try:
            preset = get_preset(args.preset)
        except SynthSpecError as exc:
            raise UserError(f"synth: {exc}") from None
    try:
        if args.preset is not None:
            if args.arch is not None:
                raise SynthSpecError(f"--arch cannot be combined with --preset (the preset "
                                     f"{preset.name} is {preset.arch})")
            return preset.spec(**{"dtype": DEFAULT_DTYPE, **given})
        arch = args.arch or _DEFAULTS.arch
        given.setdefault("shared_experts", 1 if arch in SHARED_EXPERT_ARCHS else 0)
        return SynthSpec(arch=arch, **given)
    except SynthSpecError as exc:
        raise UserError(f"{where}: {exc}") from None


def preset_table() -> str:
    """``--list-presets``: each preset's shape and its planned file size per dtype."""
    from gguf_tools.synth import planned_file_bytes  # noqa: PLC0415 - loads gguf-py

    head = (f"{'preset':<17} {'model':<17} {'arch':<9} {'layers':>6} {'experts':>7} "
            f"{'top-k':>5} {'vocab':>7} " + " ".join(f"{dtype:>10}" for dtype in PRESET_DTYPES))
    lines = [head]
    for preset in PRESETS.values():
        sizes = [format_size(planned_file_bytes(preset.spec(dtype))) for dtype in PRESET_DTYPES]
        lines.append(f"{preset.name:<17} {preset.model:<17} {preset.arch:<9} "
                     f"{preset.layers:>6} {preset.experts:>7} {preset.top_k:>5} "
                     f"{preset.n_vocab:>7} " + " ".join(f"{size:>10}" for size in sizes))
    lines.append("file sizes as written by `moe-offload synth --preset NAME --dtype DTYPE`; "
                 "gpt-oss experts are MXFP4 at every dtype")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    if args.list_presets:
        print(preset_table())
        return 0
    if not args.out:
        raise UserError("synth: give OUT.gguf, the file to write (or --list-presets)")
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
        shape = f"preset {args.preset}, " if args.preset else ""
        print(f"wrote {out}: {shape}{spec.arch}, {spec.layers} layers, {spec.experts} experts "
              f"(top-{spec.top_k}), embd {spec.embd}, expert ff {spec.ff}, {spec.dtype}, "
              f"{format_size(out.stat().st_size)}")
    return 0
