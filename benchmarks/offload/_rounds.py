"""The rounds of benchmarks/offload: which part runs when, and one row from a part's rounds.

The `train-*` parts run `--rounds` times, in alternating order, so that no train part
always runs right after the same one (a host warms up, its page cache fills, its clock
drifts over minutes; one-GPU hosts differ by 10-20% and one run of each row cannot tell a
few percent apart). So does `adam-torch-fused`, the CPU's resource alone: on one H200
host it ran at 3.72 and 4.70 G parameters/s in two runs minutes apart, while the training
step it judges stayed within 0.5% (docs/benchmarks.md "offload-ratio"); its figure is the
median of its rounds. Every other part measures a resource alone and runs once (the GPU's
and the bus's did not move between runs).
"""

from __future__ import annotations

import statistics
from typing import Any

SKIPPED = "skipped: time budget spent"
# The resource alone that runs every round beside the train parts (see above).
CPU_RESOURCE = "adam-torch-fused"


def is_train(part: str) -> bool:
    """Whether `part` trains the model (and so runs every round)."""
    return part.startswith("train-")


def runs_every_round(part: str) -> bool:
    """Whether `part` runs in every round: the train parts and the CPU's resource."""
    return is_train(part) or part == CPU_RESOURCE


def schedule(parts: list[str], rounds: int) -> list[tuple[str, int]]:
    """(part, round index) in the order to run them: round 0 is `parts` as listed, every
    part once; later rounds run the parts that run every round only, reversed in odd
    rounds."""
    again = [p for p in parts if runs_every_round(p)]
    order = [(p, 0) for p in parts]
    for index in range(1, rounds):
        order += [(p, index) for p in (again[::-1] if index % 2 else again)]
    return order


def _failed(runs: list[dict[str, Any]], rounds: int) -> dict[str, Any] | None:
    """The row of a part whose rounds give no median: its first failed round, named, or
    the budget's skip where every round was skipped; None where some round ran."""
    for index, r in enumerate(runs):
        if not r["ok"] and r["error"] != SKIPPED:
            where = f"round {index + 1}/{rounds}: " if rounds > 1 else ""
            return {**r, "error": where + r["error"]}
    return None if any(r["ok"] for r in runs) else runs[0]


def combine_rate(runs: list[dict[str, Any]], rounds: int) -> dict[str, Any]:
    """The CPU's resource from its runs in the order run: the first failed round is the
    row; else the median rate (and step), each round's rate, and the wall time of all."""
    failed = _failed(runs, rounds)
    if failed is not None:
        return failed
    done = [r for r in runs if r["ok"]]
    return {
        **done[-1],
        "params_per_s": statistics.median(r["params_per_s"] for r in done),
        "step_s": statistics.median(r["step_s"] for r in done),
        "rounds_params_per_s": [r["params_per_s"] for r in done],
        "rounds_wall_s": [r["wall_s"] for r in done],
        "wall_s": sum(r["wall_s"] for r in done),
    }


def combine(runs: list[dict[str, Any]], rounds: int, tokens: int) -> dict[str, Any]:
    """One train row from its runs in the order run (`tokens` per step): the first failed
    round is the row (no median); else the median step (tokens/s from it) and init, the
    largest peaks, each round's step, the fastest and slowest step of any round, and how
    many rounds the budget skipped."""
    failed = _failed(runs, rounds)
    if failed is not None:
        return failed
    done = [r for r in runs if r["ok"]]
    step = statistics.median(r["step_s"] for r in done)
    return {
        **done[-1],
        "step_s": step,
        "tokens_per_s": tokens / step,
        "init_s": statistics.median(r["init_s"] for r in done),
        "gpu_peak_gib": max(r["gpu_peak_gib"] for r in done),
        "host_peak_gib": max(r["host_peak_gib"] for r in done),
        "rounds_step_s": [r["step_s"] for r in done],
        "fastest_step_s": min(r["fastest_step_s"] for r in done),
        "slowest_step_s": max(r["slowest_step_s"] for r in done),
        "rounds_wall_s": [r["wall_s"] for r in done],
        "wall_s": sum(r["wall_s"] for r in done),
        "skipped_rounds": len(runs) - len(done),
    }
