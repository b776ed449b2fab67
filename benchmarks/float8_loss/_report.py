"""The markdown and the figure of benchmarks/float8_loss."""

from __future__ import annotations

import argparse
import importlib.metadata
import statistics
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
    """The settings, one row per seed and the goal, judged on the mean over the seeds."""
    pairs = [(runs[i], runs[i + 1]) for i in range(0, len(runs), 2)]
    bf16s = [b.held_out for b, _ in pairs]
    bf16_mean = statistics.fmean(bf16s)
    fp8_mean = statistics.fmean(f.held_out for _, f in pairs)
    gap = (fp8_mean - bf16_mean) / bf16_mean
    spread = (max(bf16s) - min(bf16s)) / bf16_mean
    rows = [
        [
            str(b.seed),
            f"{b.held_out:.4f}",
            f"{f.held_out:.4f}",
            f"{(f.held_out - b.held_out) / b.held_out:+.2%}",
            f"{_tail(b.losses):.4f} / {_tail(f.losses):.4f}",
            f"{b.losses[0]:.4f} / {f.losses[0]:.4f}",
            f"{b.seconds:.0f} / {f.seconds:.0f}",
        ]
        for b, f in pairs
    ]
    fp8_label = pairs[0][1].label
    lines = [
        f"examples/train_gpt.py, GPT `{args.preset}` on examples/data/corpus.txt (byte-level), "
        f"zeroshard stage 3, bf16 compute (fp32 masters), {args.ranks} rank(s), global batch "
        f"{args.batch}, {args.steps} steps, the example's AdamW and schedule; each seed "
        "(init and data order) trained bf16, then fp8 with the same seed; the fp8 run "
        f"(`{fp8_label}`) converts every block's linears with torchao "
        f"{importlib.metadata.version('torchao')} (`{args.recipe}`"
        + (", weights gathered in fp8" if args.recipe == "tensorwise" else "")
        + f"), torch {torch_version}. Held-out: the mean loss over {args.eval_batches} "
        "batches the training does not draw from, after the last step; train: rank 0's "
        "loss, mean of the last tenth of the steps; wall: the whole torchrun launch.",
        "",
        markdown_table(
            [
                "seed",
                "bf16 held-out",
                "fp8 held-out",
                "fp8 vs bf16",
                "train (last 10%) bf16 / fp8",
                "first step's loss bf16 / fp8",
                "wall s bf16 / fp8",
            ],
            rows,
        ),
        "",
        f"Mean held-out loss over {len(pairs)} seed(s): bf16 {bf16_mean:.4f}, fp8 "
        f"{fp8_mean:.4f}: fp8 {gap:+.2%} (goal: within {GOAL:.0%}; "
        f"{'met' if abs(gap) <= GOAL else 'MISSED'})."
        + (
            f" bf16's own held-out loss spans {spread:.2%} of its mean across the seeds."
            if len(pairs) > 1
            else ""
        ),
    ]
    if png is not None:
        lines += ["", f"![training loss per step, bf16 and fp8, seed 0]({png})"]
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
