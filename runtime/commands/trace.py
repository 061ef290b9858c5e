"""``moe-offload trace``: routing trace files.

    moe-offload trace convert IN OUT        # CSV <-> binary (.rtb), format chosen by OUT's suffix
    moe-offload trace synth -o OUT [...]    # a synthetic trace (skewed popularity, reuse)
    moe-offload trace info TRACE [...]      # shape and counts of a trace
    moe-offload trace record ...            # live capture (runtime.commands.trace_record), when built
"""
from __future__ import annotations

import argparse
import importlib
import os
import sys
from pathlib import Path

import numpy as np

from runtime.errors import UserError
from runtime.traces.files import is_csv_path, read_trace, trace_integrity, write_trace
from runtime.traces.synthetic import SynthTraceSpec, synthesize
from runtime.traces.trace import PHASE_DECODE, PHASE_PREFILL
from runtime.units import format_size, parse_size_arg

try:  # the live-capture subcommand lives with the engine; absent until that module exists
    _record = importlib.import_module("runtime.commands.trace_record")
except ModuleNotFoundError as exc:
    if exc.name != "runtime.commands.trace_record":
        raise
    _record = None


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("trace", help="record, convert and synthesize routing traces",
                                   description="Routing trace files: route_trace v1 CSV and "
                                               "the binary .rtb format.")
    sub = parser.add_subparsers(dest="trace_command", metavar="SUBCOMMAND")
    parser.set_defaults(func=lambda args: _usage(parser))

    conv = sub.add_parser("convert", help="convert between CSV and binary (.rtb)",
                          description="Read a trace in either format and write it as CSV "
                                      "(OUT ends in .csv) or binary (anything else).")
    conv.add_argument("input", metavar="IN")
    conv.add_argument("output", metavar="OUT")
    conv.set_defaults(func=run_convert)

    d = SynthTraceSpec()
    syn = sub.add_parser("synth", help="write a synthetic routing trace",
                         formatter_class=argparse.ArgumentDefaultsHelpFormatter,
                         description="A synthetic routing trace: per-layer Zipf popularity "
                                     "(--skew) mixed with the previous token's experts "
                                     "(--reuse), prefill in chunks then decode.")
    syn.add_argument("-o", "--output", required=True, metavar="OUT",
                     help="file to write (.csv: CSV, else binary)")
    syn.add_argument("--layers", type=int, default=d.n_layer, help="MoE layers")
    syn.add_argument("--experts", type=int, default=d.n_expert, help="experts per layer")
    syn.add_argument("--top-k", type=int, default=d.top_k, help="experts per token")
    syn.add_argument("--prompt", type=int, default=d.prompt_tokens, help="prompt tokens")
    syn.add_argument("--decode", type=int, default=d.decode_tokens, help="decode tokens")
    syn.add_argument("--chunk", type=int, default=d.chunk, help="prefill tokens per batch")
    syn.add_argument("--skew", type=float, default=d.skew,
                     help="Zipf exponent of expert popularity (0 = uniform)")
    syn.add_argument("--reuse", type=float, default=d.reuse,
                     help="weight of the previous token's experts, 0..1")
    syn.add_argument("--seed", type=int, default=d.seed)
    syn.add_argument("--expert-bytes", default=str(d.expert_bytes[0]),
                     help="bytes of one expert (units allowed: 3MiB)")
    syn.add_argument("--dense-bytes", default=str(d.dense_bytes[0]),
                     help="bytes of a layer's dense tensors")
    syn.add_argument("--model", metavar="MODEL.gguf",
                     help="take layers, experts, top-k and bytes from this model")
    syn.set_defaults(func=run_synth)

    info = sub.add_parser("info", help="print a trace's shape, counts and integrity",
                          description="Shape and counts of each trace, and whether it is "
                                      "intact (a .rtb's checksum verified) or has no checksum "
                                      "(CSV, .rtb version 1). A corrupt file is one line on "
                                      "stderr and exit status 2; the other files are still "
                                      "shown.")
    info.add_argument("traces", nargs="+", metavar="TRACE")
    info.set_defaults(func=run_info)

    if _record is not None:
        _record.register_record(sub)


def _usage(parser: argparse.ArgumentParser) -> int:
    parser.print_help(sys.stderr)
    return 2


def run_convert(args: argparse.Namespace) -> int:
    src, dst = Path(args.input), Path(args.output)
    if dst.exists() and src.exists() and os.path.samefile(src, dst):
        raise UserError(f"{dst}: output is the input file")
    trace = read_trace(src)
    write_trace(trace, dst)
    kind = "route_trace v1 CSV" if is_csv_path(dst) else "binary trace"
    print(f"wrote {dst}: {len(trace):,} rows ({kind}, {format_size(dst.stat().st_size)})")
    return 0



def run_synth(args: argparse.Namespace) -> int:
    fields = dict(n_layer=args.layers, n_expert=args.experts, top_k=args.top_k,
                  prompt_tokens=args.prompt, decode_tokens=args.decode, chunk=args.chunk,
                  skew=args.skew, reuse=args.reuse, seed=args.seed,
                  expert_bytes=(parse_size_arg(args.expert_bytes, "--expert-bytes"),),
                  dense_bytes=(parse_size_arg(args.dense_bytes, "--dense-bytes"),))
    if args.model:
        from runtime.traces.model_header import header_from_model
        h = header_from_model(args.model)
        moe = [layer for layer, b in enumerate(h.expert_bytes) if b > 0]
        if len(moe) != h.n_layer:
            raise UserError(f"{args.model}: has dense layers; synthetic traces route every "
                            f"layer (use --layers and --expert-bytes instead)")
        fields.update(n_layer=h.n_layer, n_expert=h.n_expert, top_k=h.n_expert_used,
                      expert_bytes=h.expert_bytes, dense_bytes=h.dense_bytes,
                      arch=h.arch, model=h.model)
    try:
        spec = SynthTraceSpec(**fields)
    except ValueError as err:
        raise UserError(f"trace synth: {err}") from None
    trace = synthesize(spec)
    write_trace(trace, args.output)
    print(f"wrote {args.output}: {len(trace):,} rows, {spec.n_layer} layers x "
          f"{spec.n_expert} experts, top-{spec.top_k}, {spec.prompt_tokens} prompt + "
          f"{spec.decode_tokens} decode tokens")
    return 0


def run_info(args: argparse.Namespace) -> int:
    failed = 0
    for path in args.traces:
        try:
            t = read_trace(path)
            state = trace_integrity(path)
        except UserError as err:
            sys.stderr.write(f"moe-offload: error: {err}\n")
            failed += 1
            continue
        h = t.header
        print(f"{path}: {len(t):,} rows; model {h.model} ({h.arch}), {h.n_layer} layers x "
              f"{h.n_expert} experts, top-{h.n_expert_used}; expert bytes "
              f"{format_size(h.total_expert_bytes)} in all")
        for phase, name in ((PHASE_PREFILL, "prefill"), (PHASE_DECODE, "decode")):
            m = t.phase == phase
            if m.any():
                keys = np.unique(t.keys()[m])
                print(f"  {name}: {int(m.sum()):,} accesses, {t.token_count(phase)} tokens, "
                      f"{len(keys):,} distinct experts")
        print(f"  layer batches: {len(t.batch_bounds()) - 1:,}")
        print(f"  integrity: {state}")
    return 2 if failed else 0
