"""``moe-offload replay``: run routing traces through the residency manager, simulated.

    moe-offload replay TRACE [TRACE...] --capacity SIZE [--capacity SIZE...]
        [--policy NAME | --config FILE ...] [--cost FILE] [--profile FILE] [--json]
        [--plot OUT.png]

SIZE is bytes with units (``6GiB``), a share of the trace model's expert bytes (``20%``), or
``recorded``: the pools (layers and capacities) of the device a live run recorded the trace
with (``trace record --config ...``), which replays that run's decisions exactly.
Each policy / config is a row (without one: ``DEFAULT_POLICIES``), each capacity a column;
every cell also gets the Belady ceiling of its trace and capacity. Output: the markdown matrix
(default; on a terminal without HTML) or a JSON list of cells.
Prefetches are timed on the cost model (runtime/replay/timing.py): a late one is a demand miss.
``--profile FILE`` (``moe-offload profile``) warm-starts the learned policies of every cell.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass

from runtime.errors import UserError
from runtime.residency.config import ResidencyConfig, load_config, preset_config
from runtime.traces.files import read_trace
from runtime.units import parse_percent, parse_size

DEFAULT_POLICIES = ("lru", "lfu-decay", "next-visit")   # rows when none is given

@dataclass(frozen=True)
class Capacity:
    """A ``--capacity`` value: fixed bytes or a share of a trace's total expert bytes."""

    label: str
    bytes: int | None = None
    share: float | None = None
    recorded: bool = False       # the trace's recorded device pools

    def resolve(self, total_expert_bytes: int) -> int | None:
        """Bytes; None for ``recorded`` (the trace's own pools)."""
        if self.recorded:
            return None
        if self.bytes is not None:
            return self.bytes
        return max(1, int(self.share * total_expert_bytes))


def parse_capacity(text: str) -> Capacity:
    """``--capacity`` text to a ``Capacity``; UserError on anything else."""
    if text.strip() == "recorded":
        return Capacity("recorded", recorded=True)
    try:
        share = parse_percent(text)
        if share is not None:
            return Capacity(text, share=share)
        return Capacity(text, bytes=parse_size(text))
    except ValueError as err:
        raise UserError(f"--capacity: {err}") from None


class _Row(argparse.Action):
    """``--policy`` and ``--config`` share one list, so rows keep the command line's order."""

    def __call__(self, parser, namespace, values, option_string=None):
        rows = list(getattr(namespace, self.dest, None) or [])
        rows.append((option_string, values))
        setattr(namespace, self.dest, rows)


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "replay", help="replay routing traces through the residency manager (simulated)",
        description="Replay routing traces through ExpertResidencyManager in simulated mode "
                    "and score policies by demand-miss bytes against the Belady ceiling.")
    p.add_argument("traces", nargs="+", metavar="TRACE", help="route_trace v1 CSV or .rtb")
    p.add_argument("--capacity", action="append", required=True, metavar="SIZE",
                   help="fast-tier expert capacity: bytes with units (6GiB), a share of "
                        "the model's expert bytes (20%%), or 'recorded' (the pools of the "
                        "device the trace was recorded with); repeat for more columns")
    p.add_argument("--policy", action=_Row, dest="rows", default=[], metavar="NAME",
                   help="eviction policy under demand admission (lru, lfu, lfu-decay, "
                        "phase-weighted, next-visit), belady (offline, with bypass) or "
                        "belady-forced; repeat for more rows (default: "
                        f"{', '.join(DEFAULT_POLICIES)})")
    p.add_argument("--config", action=_Row, dest="rows", metavar="FILE",
                   help="residency TOML with phase-specific policies; repeat for more rows")
    p.add_argument("--cost", metavar="FILE",
                   help="take the [cost] table of this TOML for every row")
    p.add_argument("--profile", metavar="FILE",
                   help="a routing profile of the same model (moe-offload profile) to "
                        "warm-start next-visit and affinity in every cell")
    p.add_argument("--json", action="store_true", help="print a JSON list of cells")
    p.add_argument("--plot", metavar="OUT.png", help="write a PNG of demand-miss bytes "
                                                     "against capacity (its path is said on "
                                                     "stderr)")
    p.set_defaults(func=run)


def _rows(args: argparse.Namespace) -> list[tuple[str, ResidencyConfig]]:
    if not args.rows:
        args.rows = [("--policy", name) for name in DEFAULT_POLICIES]
    rows = [(value, preset_config(value) if flag == "--policy" else load_config(value))
            for flag, value in args.rows]
    if args.cost:
        cost = load_config(args.cost).cost
        rows = [(label, _with_cost(cfg, cost)) for label, cfg in rows]
    labels = [label for label, _ in rows]
    if len(set(labels)) != len(labels):
        raise UserError(f"replay: a policy or config is given twice ({labels})")
    return rows


def _with_cost(config: ResidencyConfig, cost) -> ResidencyConfig:
    from dataclasses import replace
    return replace(config, cost=cost)


def run(args: argparse.Namespace) -> int:
    from runtime.replay.harness import prepare, replay_cell   # imports the manager

    started = time.perf_counter()
    capacities = [parse_capacity(text) for text in args.capacity]
    if len({c.label.strip() for c in capacities}) != len(capacities):
        raise UserError(f"--capacity: a value is given twice ({', '.join(args.capacity)})")
    rows = _rows(args)
    traces = [(path, read_trace(path)) for path in args.traces]
    profile = None
    if args.profile:
        from runtime.residency.profile import read_profile
        profile = read_profile(args.profile)
        for path, trace in traces:
            h = trace.header
            profile.check_model(h.n_layer, h.n_expert, h.expert_bytes,
                                f"{args.profile} (for {path})")
    cells = []
    preps = []
    for path, trace in traces:
        prep = prepare(trace, name=path)
        preps.append(prep)
        total = trace.header.total_expert_bytes
        if any(c.recorded for c in capacities) and not trace.header.pools:
            raise UserError(f"{path}: --capacity recorded: the trace recorded no device pools "
                            "(record it with `trace record --config FILE` naming a device)")
        for label, config in rows:
            for cap in capacities:
                cells.append(replay_cell(prep, cap.resolve(total), config, label=label,
                                         capacity_label=cap.label, profile=profile))
    replayed = sum(p.accesses * p.runs for p in preps)
    if args.json:
        json.dump([c.to_json() for c in cells], sys.stdout, indent=1)
        sys.stdout.write("\n")
    else:
        from runtime.replay.report import matrix_markdown
        # a file or pipe gets markdown with a folded <details> table; a terminal plain text
        sys.stdout.write(matrix_markdown(cells, html=not sys.stdout.isatty()))
    sys.stdout.flush()
    if args.plot:
        from runtime.replay.plot import plot_matrix
        plot_matrix(cells, args.plot)
        sys.stderr.write(f"replay: plot written to {args.plot}\n")
    elapsed = time.perf_counter() - started
    sys.stderr.write(f"replay: {len(cells)} cells, {replayed:,} accesses through the manager "
                     f"in {elapsed:.2f} s ({replayed / max(elapsed, 1e-9):,.0f}/s, Belady "
                     f"ceilings and reading included)\n")
    return 0
