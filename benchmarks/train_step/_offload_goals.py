"""The optimizer offloaded on one GPU (issue 73, want 3): each offload engine against the
same engine with its optimizer on the device (the step, the device memory at peak and kept
between steps, with AdamW or Muon as `--optimizer` says), and the goal that the compiled
offload step be at least as fast as the eager one, from the engines of the run only."""

from __future__ import annotations

from benchmarks._common import markdown_table
from benchmarks.train_step._goals import _speed
from benchmarks.train_step._result import Result

# Each offload engine and its twin on the device.
PAIRS = (("zs2-off", "zs2"), ("zs3-off", "zs3"), ("zs3c-off", "zs3c"))
# Want 3: `zeroshard.compile` with offload at least as fast as the eager offload step.
COMPILED_OVER_EAGER = 1.0


def _fmt(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def _status(r: Result) -> str:
    return f"FAILED: {r.error}" if r.error is not None else f"skipped: {r.skipped}"


def offload_goals(every: dict[str, Result]) -> list[str]:
    """The offload engines of the run beside their twins, and the compiled-offload goal;
    `every` holds each engine run, failed ones too (no offload engine: no table)."""
    rows: list[list[str]] = []
    for off, dev in PAIRS:
        a, b = every.get(off), every.get(dev)
        if a is None:
            continue
        if a.step_ms is None:
            rows.append([f"`{off}`", f"`{dev}`", *["-"] * 4, _status(a)])
            continue
        ran = b is not None and b.step_ms is not None
        twin = f"{b.step_ms:.1f}" if b is not None and b.step_ms is not None else "-"
        rows.append(
            [
                f"`{off}`",
                f"`{dev}`",
                f"{a.step_ms:.1f} / {twin}",
                _fmt(_speed(every, off, dev), ".3f"),
                f"{_fmt(a.peak_gib, '.1f')} / {_fmt(b.peak_gib if b else None, '.1f')}",
                f"{_fmt(a.states_gib, '.1f')} / {_fmt(b.states_gib if b else None, '.1f')}",
                "ok" if ran else f"`{dev}` not run" if b is None else f"`{dev}` {_status(b)}",
            ]
        )
    if not rows:
        return []
    header = [
        "offload",
        "on the device",
        "step ms, offload / device",
        "speed, offload / device",
        "peak GiB, offload / device",
        "states GiB, offload / device",
        "",
    ]
    lines = [
        "The optimizer offloaded to the CPU (`offload_optimizer`: masters and optimizer "
        "state on the host, stepped there; Muon orthogonalizes on the device) against the "
        "same engine with everything on the device, from this run (speed: tokens/s ratio, "
        "> 1 is faster; peak and states: device memory as in the table above).",
        "",
        markdown_table(header, rows),
    ]
    compiled = every.get("zs3c-off")
    if compiled is not None:
        speed = _speed(every, "zs3c-off", "zs3-off")
        target = f">= {COMPILED_OVER_EAGER:g}"
        status = (
            "not measured" if speed is None else "met" if speed >= COMPILED_OVER_EAGER else "MISSED"
        )
        lines += [
            "",
            "Goal of issue 73 (want 3): zeroshard.compile with offload at least as fast as "
            "the eager offload step.",
            "",
            markdown_table(
                ["goal", "figure", "target", "status"],
                [["`zs3c-off` speed / `zs3-off`", _fmt(speed, ".3f"), target, status]],
            ),
        ]
    return lines
