"""``moe-offload inspect MODEL.gguf [--json]``: architecture, MoE layers and expert bytes.

The model is opened read-only. Bad input (missing path, a directory, not a GGUF, a truncated
GGUF, a dense model) is one line naming the file and the problem, and exit code 2.
"""
from __future__ import annotations

import argparse
import json
import sys

from typing import TYPE_CHECKING

from runtime.units import format_size

if TYPE_CHECKING:
    from gguf_tools.expert_index import ExpertIndex


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "inspect", help="show a MoE GGUF model's layers, experts and expert bytes",
        description="Show a mixture-of-experts GGUF model's architecture, which layers are MoE, "
                    "and the bytes of one expert per layer.")
    parser.add_argument("model", metavar="MODEL.gguf", help="the GGUF model file")
    parser.add_argument("--json", action="store_true",
                        help="print one JSON object instead of a table")
    parser.set_defaults(func=run)


def layer_types(index: ExpertIndex, layer: int) -> dict[str, str]:
    """Projection ("gate", "down.bias", ...) -> ggml type of ``layer``'s expert tensors."""
    out = {}
    for t in index.tensors(layer):
        key = t.projection if t.kind == "weight" else f"{t.projection}.{t.kind}"
        out[key] = t.ggml_type
    return out


def inspect_json(index: ExpertIndex) -> dict[str, object]:
    """The ``--json`` object: every ``ModelFacts`` field plus per-layer expert tensor types."""
    data = index.facts.to_json()
    data["expert_types"] = [layer_types(index, layer) for layer in range(index.facts.n_layer)]
    return data


def format_table(index: ExpertIndex) -> str:
    """A human-readable summary."""
    f = index.facts
    share = f.total_expert_bytes / max(1, f.total_expert_bytes + f.dense_bytes)
    lines = [
        f"{f.path}",
        f"  arch {f.arch}, {f.n_layer} layers, {f.n_expert} experts (top-{f.n_expert_used}), "
        f"embd {f.n_embd}, expert ff {f.n_ff_exp}, shared experts {f.n_shared_experts}, "
        f"context {f.context_length}",
        f"  MoE layers: {_ranges(f.moe_layers)} ({len(f.moe_layers)} of {f.n_layer})",
        f"  experts {format_size(f.total_expert_bytes)} ({share:.0%} of weights), "
        f"dense {format_size(f.dense_bytes)}, file {format_size(f.file_bytes)}",
        "",
        f"  {'layer':>5}  {'bytes/expert':>12}  {'all experts':>11}  types",
    ]
    for layer in range(f.n_layer):
        per = f.expert_bytes[layer]
        types = ", ".join(f"{k} {v}" for k, v in layer_types(index, layer).items()) or "dense"
        lines.append(f"  {layer:>5}  {per:>12,}  {format_size(per * f.n_expert):>11}  {types}")
    return "\n".join(lines)


def _ranges(ids: tuple[int, ...]) -> str:
    if not ids:
        return "none"
    parts, start, prev = [], ids[0], ids[0]
    for i in ids[1:] + (None,):
        if i is not None and i == prev + 1:
            prev = i
            continue
        parts.append(f"{start}-{prev}" if prev != start else f"{start}")
        if i is not None:
            start = prev = i
    return ", ".join(parts)


def run(args: argparse.Namespace) -> int:
    from gguf_tools.expert_index import ExpertIndex  # noqa: PLC0415

    index = ExpertIndex.open(args.model)
    if args.json:
        json.dump(inspect_json(index), sys.stdout, indent=1)
        sys.stdout.write("\n")
    else:
        print(format_table(index))
    return 0
