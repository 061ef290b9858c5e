#!/usr/bin/env python3
"""Generality check of a policy change on the real traces: each trace is cut into two halves
(its prefill plus the first, or the second, half of its decode tokens) and each half replayed
at 10 / 20 / 30 % of the expert bytes; a change that helps should move both halves the same
way. Prints decode demand-miss bytes / Belady for lru, next-visit and a config.

    python scripts/replay_halves.py [--config configs/best-replay.toml] TRACE...
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from runtime.replay.harness import prepare, replay_cell  # noqa: E402
from runtime.residency.config import load_config, preset_config  # noqa: E402
from runtime.traces.files import read_trace  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    ap.add_argument("traces", nargs="+")
    ap.add_argument("--config", default="configs/best-replay.toml")
    args = ap.parse_args()
    policies = (("lru", preset_config("lru")), ("next-visit", preset_config("next-visit")),
                (args.config, load_config(args.config)))
    print(f"command: {' '.join(sys.argv)}")
    print("decode demand-miss / Belady at 10%, 20%, 30%: " + " / ".join(p for p, _ in policies))
    for path in args.traces:
        t = read_trace(path)
        dec = t.phase == 1
        steps = np.unique(t.step[dec])
        mid = steps[len(steps) // 2]
        total = sum(int(b) for b in t.header.expert_bytes) * t.header.n_expert
        for half, rows in (("first", ~dec | (t.step < mid)), ("second", ~dec | (t.step >= mid))):
            prep = prepare(t.take(np.flatnonzero(rows)), name=f"{Path(path).name} {half}")
            cells = []
            for share in (0.1, 0.2, 0.3):
                r = [replay_cell(prep, int(total * share), cfg, label=name)
                     for name, cfg in policies]
                cells.append("/".join(
                    f"{c.decode.demand_miss_bytes / c.belady_decode_demand_miss_bytes:.2f}"
                    for c in r))
            print(f"{prep.name:32s} " + "   ".join(cells))
    return 0


if __name__ == "__main__":
    sys.exit(main())
