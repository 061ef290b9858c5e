#!/usr/bin/env python3
"""The replay matrix of docs/replay-matrix.md: policy rows x (trace, capacity) columns, decode demand-miss
bytes as a ratio to the cell's Belady ceiling, their geometric means (also against
forced-admission Belady, the issue's yardstick for eviction), and the worst cell's total bytes
moved against lru's.

    moe-offload replay TRACE... --capacity 10% ... --policy lru ... --policy belady-forced \\
        --policy belady --json > cells.json
    python scripts/replay_matrix.py cells.json

Needs the lru and belady-forced rows for the last two columns.
"""
from __future__ import annotations

import json
import math
import sys
from pathlib import Path


def main() -> int:
    if len(sys.argv) != 2:
        sys.stderr.write(__doc__.split("\n\n")[1] + "\n")
        return 2
    try:
        cells = json.loads(Path(sys.argv[1]).read_text())
    except (OSError, ValueError) as exc:
        sys.stderr.write(f"replay_matrix: {sys.argv[1]}: cannot read ({exc})\n")
        return 2
    columns = list(dict.fromkeys((c["trace"], c["capacity"]) for c in cells))
    policies = list(dict.fromkeys(c["policy"] for c in cells))
    by = {(c["policy"], c["trace"], c["capacity"]): c for c in cells}
    names = [f"{Path(t).name.split('.')[0]} {cap}" for t, cap in columns]
    print("| policy | " + " | ".join(names) + " | geo. mean (vs forced Belady) | "
          "bytes moved vs lru (worst cell) |")
    print("|---" * (len(columns) + 3) + "|")
    for p in policies:
        ratios, forced, moved = [], [], []
        for t, cap in columns:
            c = by[(p, t, cap)]
            dec = c["decode"]["demand_miss_bytes"]
            ratios.append(dec / c["belady_decode_demand_miss_bytes"])
            f = by.get(("belady-forced", t, cap))
            if f is not None:
                forced.append(dec / f["decode"]["demand_miss_bytes"])
            lru = by.get(("lru", t, cap))
            if lru is not None:
                moved.append(c["total"]["bytes_moved"] / lru["total"]["bytes_moved"])

        def geo(xs: list[float]) -> float:
            return math.exp(sum(math.log(x) for x in xs) / len(xs))

        mean = f"{geo(ratios):.3f}x" + (f" ({geo(forced):.3f}x)" if forced else "")
        worst = f"{max(moved):.2f}x" if moved else "-"
        print(f"| {p} | " + " | ".join(f"{r:.2f}x" for r in ratios) + f" | {mean} | {worst} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
