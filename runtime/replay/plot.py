"""PNG plot of a replay matrix: demand-miss bytes against capacity, one panel per trace.

One line per policy; the Belady ceiling dashed; the cold-miss floor dotted.
"""
from __future__ import annotations

import os

from runtime.atomic_write import atomic_write
from runtime.replay.harness import CellResult

GIB = float(1 << 30)


def plot_matrix(cells: list[CellResult], path: str | os.PathLike) -> None:
    """Write the plot to ``path`` (PNG, via matplotlib's Agg backend)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    traces = list(dict.fromkeys(c.trace for c in cells))
    fig, axes = plt.subplots(1, len(traces), figsize=(6 * len(traces), 4.5), squeeze=False)
    for ax, trace in zip(axes[0], traces):
        mine = [c for c in cells if c.trace == trace]
        for policy in dict.fromkeys(c.policy for c in mine):
            if policy == "belady":
                continue  # drawn once below, from the ceilings
            pts = sorted((c.capacity_bytes, c.demand_miss_bytes) for c in mine
                         if c.policy == policy)
            ax.plot([x / GIB for x, _ in pts], [y / GIB for _, y in pts], marker="o",
                    label=policy)
        ceiling = sorted({c.capacity_bytes: c.belady_demand_miss_bytes for c in mine
                          if c.belady_demand_miss_bytes is not None}.items())
        ax.plot([x / GIB for x, _ in ceiling], [y / GIB for _, y in ceiling], "k--",
                marker="x", label="belady")
        ax.axhline(mine[0].cold_miss_bytes / GIB, color="grey", linestyle=":",
                   label="cold-miss floor")
        ax.set_title(os.path.basename(trace))
        ax.set_xlabel("fast-tier capacity (GiB)")
        ax.set_ylabel("demand-miss bytes (GiB, prefill + decode)")
        ax.set_ylim(bottom=0)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize="small")
    fig.tight_layout()
    try:
        with atomic_write(path, "wb") as f:
            fig.savefig(f, dpi=110, format=os.path.splitext(str(path))[1][1:] or "png")
    finally:
        plt.close(fig)
