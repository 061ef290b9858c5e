"""``moe-offload profile``: a routing profile from traces, to warm-start the learned policies.

    moe-offload profile TRACE [TRACE...] -o PROFILE

The traces must be of one model; their decode tokens give each expert's routing frequency
and the cross-layer affinity table (runtime/residency/profile.py). ``replay --profile
PROFILE`` seeds eviction next-visit and prefetch affinity with it.
"""
from __future__ import annotations

import argparse
import sys

from runtime.traces.files import read_trace


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "profile", help="build a routing profile (expert frequencies, cross-layer affinity) "
                        "from traces",
        description="Build a routing profile from the decode tokens of routing traces of one "
                    "model: per-layer expert frequencies and cross-layer affinities, which "
                    "warm-start eviction next-visit and prefetch affinity (replay --profile).")
    p.add_argument("traces", nargs="+", metavar="TRACE", help="route_trace v1 CSV or .rtb")
    p.add_argument("-o", "--output", required=True, metavar="PROFILE",
                   help="where to write the profile (.npz)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from runtime.residency.profile import build_profile, write_profile

    traces = [read_trace(path) for path in args.traces]
    prof = build_profile(traces, names=list(args.traces))
    write_profile(args.output, prof)
    sys.stderr.write(f"profile: {prof.decode_tokens} decode tokens of {prof.model} "
                     f"({prof.n_layer} layers x {prof.n_expert} experts) -> {args.output}\n")
    return 0
