"""The markdown of the Lightning benchmark: the step of each run, the goal, the losses."""

from __future__ import annotations

import statistics

from benchmarks._common import BenchModel, markdown_table
from benchmarks.lightning._runs import Run

GOAL = 0.02
"""The Lightning fit's step may be at most this much slower than the zs3 step (issue 63)."""

LOSS_RTOL = 0.02
"""How far apart the losses of the engine's bf16 compute and Lightning's autocast may be."""


def _median_of_rounds(rounds: list[Run]) -> float:
    return statistics.median(r.median_ms for r in rounds)


def report(
    bm: BenchModel,
    rounds: dict[str, list[Run]],
    single: Run,
    *,
    precision: str,
    micro_batch: int,
    warmup: int,
) -> str:
    """The section body: what ran, the steps with the goal, and every step's loss."""
    fit, plain = _median_of_rounds(rounds["lightning"]), _median_of_rounds(rounds["zs3"])
    over = fit / plain - 1
    rows = [
        [
            f"`{name}`",
            f"{_median_of_rounds(runs):.1f}",
            ", ".join(f"{r.median_ms:.1f}" for r in runs),
            f"{_median_of_rounds(runs) / plain:.3f}",
        ]
        for name, runs in rounds.items()
    ]
    steps = len(rounds["zs3"][0].times)
    lines = [
        f"GPT `{bm.preset}`: {bm.parameters / 1e6:,.1f} M parameters ({bm.shape}); "
        f"micro-batch {micro_batch}, one device, precision `{precision}` (zeroshard: the "
        "compute dtype, fp32 masters), `benchmarks._common.adamw`, clip off, the same random "
        "tokens every step.",
        "",
        '- `lightning`: `Trainer(strategy="zeroshard_stage_3")`.fit; a step is one batch\'s '
        "end to the next (the device synchronized there): everything the Trainer does.",
        '- `zs3`: `zs.initialize` with `{"stage": 3}` and the compute dtype, and the loop '
        "benchmarks/train_step times as `zs3` (forward, backward, step, zero_grad, sync).",
        f"- each run: the median of {steps} steps after {warmup} warm-up, on a model built "
        f"afresh; {len(rounds['zs3'])} rounds in alternating order, the median of the "
        "rounds' medians.",
        "",
        markdown_table(["run", "step ms", "each round", "/ zs3"], rows),
        "",
        f"Goal (issue 63): the Lightning fit within {GOAL:.0%} of the zs3 step: "
        f"{over:+.1%} ({'met' if over <= GOAL else 'NOT met'}).",
    ]
    fit_losses = rounds["lightning"][0].losses
    plain_losses = rounds["zs3"][0].losses
    worst = max(abs(a - b) / abs(b) for a, b in zip(fit_losses, single.losses, strict=True))
    loss_rows = [
        [str(i), f"{a:.5f}", f"{b:.5f}", f"{c:.5f}", f"{abs(a - c) / abs(c):.2e}"]
        for i, (a, b, c) in enumerate(zip(fit_losses, plain_losses, single.losses, strict=True))
    ]
    lines += [
        "",
        "Loss of every step (the first round's runs), against Lightning's single-device run "
        f'(`strategy="auto"`, precision `{precision}` as Lightning runs it: autocast under '
        "bf16-mixed):",
        "",
        markdown_table(
            ["step", "`lightning` (zs3)", "`zs3` loop", "single device", "rel. diff"], loss_rows
        ),
        "",
        f"Largest relative difference from the single-device run: {worst:.2e} "
        f"({'within' if worst <= LOSS_RTOL else 'NOT within'} {LOSS_RTOL:.0%}); the "
        f"Lightning fit and the zs3 loop agree to {_largest(fit_losses, plain_losses):.2e}.",
    ]
    return "\n".join(lines)


def _largest(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) / abs(y) for x, y in zip(a, b, strict=True))
