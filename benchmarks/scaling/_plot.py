"""The figure of benchmarks/scaling: tokens/s/GPU against GPUs, one panel per model."""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from benchmarks._common import pyplot


def plot(models: dict[str, dict[str, dict[int, Any]]], path: Path) -> bool:
    """One line per engine (model -> engine -> GPUs -> cell with `.tps`), the floor dashed;
    False if matplotlib is missing."""
    plt = pyplot()
    if plt is None or not models:
        return False
    fig, axes = plt.subplots(1, len(models), figsize=(7 * len(models), 4.8), squeeze=False)
    for ax, (model, table) in zip(axes[0], models.items(), strict=True):
        for engine, by in table.items():
            points = sorted((n, c.tps) for n, c in by.items() if c.tps)
            if not points:
                continue
            xs, ys = zip(*points, strict=True)
            if engine == "floor":
                # The floor is one GPU whatever the run's size: the median of its measurements.
                ax.axhline(statistics.median(ys), color="tab:gray", linestyle="--", label="floor")
                continue
            ax.plot(
                xs,
                ys,
                marker="s" if engine.endswith("h") else "o",
                linestyle=":" if engine.endswith("h") else "-",
                linewidth=2.2 if engine.startswith("zs") else 1.2,
                label=engine,
            )
        ax.set_xscale("log", base=2)
        ax.set_xticks([1, 2, 4, 8], ["1", "2", "4", "8\n(not lent)"])
        ax.set_xlabel("GPUs")
        ax.set_ylim(bottom=0)
        ax.set_ylabel("tokens/s/GPU (higher is better)")
        ax.set_title(model.replace("`", ""), fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle("tokens/s/GPU per engine (dashed: one GPU, no communication)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
