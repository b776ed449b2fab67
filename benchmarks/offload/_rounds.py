"""The rounds of benchmarks/offload: which part runs when, and one row from a part's rounds.

The `train-*` parts run `--rounds` times, in alternating order, so that no train part
always runs right after the same one (a host warms up, its page cache fills, its clock
drifts over minutes; one-GPU hosts differ by 10-20% and one run of each row cannot tell a
few percent apart). Every other part measures a resource alone and runs once.
"""

from __future__ import annotations

import statistics
from typing import Any

SKIPPED = "skipped: time budget spent"


def is_train(part: str) -> bool:
    """Whether `part` trains the model (and so runs every round)."""
    return part.startswith("train-")


def schedule(parts: list[str], rounds: int) -> list[tuple[str, int]]:
    """(part, round index) in the order to run them: round 0 is `parts` as listed, every
    part once; later rounds run the train parts only, reversed in odd rounds."""
    train = [p for p in parts if is_train(p)]
    order = [(p, 0) for p in parts]
    for index in range(1, rounds):
        order += [(p, index) for p in (train[::-1] if index % 2 else train)]
    return order


def combine(runs: list[dict[str, Any]], rounds: int, tokens: int) -> dict[str, Any]:
    """One train row from its runs in the order run (`tokens` per step): the first failed
    round is the row (no median); else the median step (tokens/s from it) and init, the
    largest peaks, each round's step, the fastest and slowest step of any round, and how
    many rounds the budget skipped."""
    for index, r in enumerate(runs):
        if not r["ok"] and r["error"] != SKIPPED:
            where = f"round {index + 1}/{rounds}: " if rounds > 1 else ""
            return {**r, "error": where + r["error"]}
    done = [r for r in runs if r["ok"]]
    if not done:
        return runs[0]
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
