"""The markdown and the figure of benchmarks/float8_loss."""

from __future__ import annotations

import argparse
import importlib.metadata
from pathlib import Path
from typing import TYPE_CHECKING

from benchmarks._common import markdown_table, pyplot

if TYPE_CHECKING:
    from benchmarks.float8_loss.__main__ import Run

# Issue 61: the fp8 run's final loss within this fraction of bf16's.
GOAL = 0.01


def _tail(losses: list[float]) -> float:
    """The mean training loss of the last tenth of the steps (at least one)."""
    n = max(1, len(losses) // 10)
    return sum(losses[-n:]) / n


def report(runs: list[Run], args: argparse.Namespace, torch_version: str, png: str | None) -> str:
    """The settings, one row per run and the goal."""
    bf16, fp8 = runs
    gap = (fp8.held_out - bf16.held_out) / bf16.held_out
    rows = [
        [
            r.label,
            f"{r.held_out:.4f}",
            f"{_tail(r.losses):.4f}",
            f"{r.losses[0]:.4f}",
            f"{r.seconds:.0f}",
        ]
        for r in runs
    ]
    lines = [
        f"examples/train_gpt.py, GPT `{args.preset}` on examples/data/corpus.txt (byte-level), "
        f"zeroshard stage 3, bf16 compute (fp32 masters), {args.ranks} rank(s), global batch "
        f"{args.batch}, {args.steps} steps, the example's AdamW and schedule, the same seed "
        f"and data order; the fp8 run converts every block's linears with torchao "
        f"{importlib.metadata.version('torchao')} (`{args.recipe}`"
        + (", weights gathered in fp8" if args.recipe == "tensorwise" else "")
        + f"), torch {torch_version}. Held-out: the mean loss over {args.eval_batches} "
        "batches the training does not draw from, after the last step; train: rank 0's "
        "loss, mean of the last tenth of the steps; wall: the whole torchrun launch.",
        "",
        markdown_table(
            ["run", "held-out loss", "train loss (last 10%)", "first step's loss", "wall s"],
            rows,
        ),
        "",
        f"fp8's held-out loss against bf16's: {gap:+.2%} (goal: within {GOAL:.0%}; "
        f"{'met' if abs(gap) <= GOAL else 'MISSED'}).",
    ]
    if png is not None:
        lines += ["", f"![training loss per step, bf16 and fp8]({png})"]
    return "\n".join(lines)


def plot(runs: list[Run], path: Path, title: str) -> bool:
    """The training loss per step of every run; False where matplotlib is missing."""
    plt = pyplot()
    if plt is None:
        return False
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for r in runs:
        ax.plot(range(len(r.losses)), r.losses, label=r.label, linewidth=1)
    ax.set_xlabel("step")
    # Log scale: the runs' gap late in training, where the loss is small, stays visible.
    ax.set_yscale("log")
    ax.set_ylabel("training loss (rank 0, log scale)")
    ax.set_title(title)
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
