"""The goals table of issue 61 (fp8 training at the speed of its floor), from the fp8
engines of a run and the bf16 engines beside them: speed ratios of the same run only."""

from __future__ import annotations

from benchmarks._common import markdown_table
from benchmarks.train_step._goals import _speed
from benchmarks.train_step._result import Result

_FP8_ENGINES = ("zs3-fp8", "zs3-fp8g", "zs3c-fp8", "zs3c-fp8g")


def _kept(by: dict[str, Result], fp8: str, bf16: str, floor8: str, floor: str) -> float | None:
    """The share of its floor's fp8 gain an engine keeps: (its fp8 speed over its bf16
    speed) over (the fp8 floor's speed over the bf16 floor's)."""
    ours, floors = _speed(by, fp8, bf16), _speed(by, floor8, floor)
    return None if ours is None or floors is None else ours / floors


def float8_goals(by: dict[str, Result]) -> list[str]:
    """Issue 61's goals for the fp8 engines this run measured (none ran: no table)."""
    if not any(e in by for e in _FP8_ENGINES):
        return []
    rows: list[list[str]] = []

    def goal(what: str, figure: float | None, limit: float | None) -> None:
        if figure is None:
            rows.append([what, "not measured", "-", "-"])
        elif limit is None:
            rows.append([what, f"{figure:.3f}", "-", "-"])
        else:
            status = "met" if figure >= limit else "MISSED"
            rows.append([what, f"{figure:.3f}", f">= {limit:g}", status])

    for engine in ("zs3c-fp8", "zs3c-fp8g"):
        goal(f"`{engine}` speed / `floorc8`", _speed(by, engine, "floorc8"), 0.98)
    for engine in ("zs3-fp8", "zs3-fp8g"):
        goal(f"`{engine}` speed / `floor8`", _speed(by, engine, "floor8"), 0.97)
    for engine in ("zs3c-fp8", "zs3c-fp8g"):
        goal(
            f"`{engine}` / `zs3c` over `floorc8` / `floorc` (the fp8 gain kept)",
            _kept(by, engine, "zs3c", "floorc8", "floorc"),
            0.98,
        )
    goal("`floorc8` speed / `floorc` (the floor's fp8 gain)", _speed(by, "floorc8", "floorc"), None)
    # fp32 masters by hand, compiled: what of the gap to `floorc8` the masters' work is.
    goal(
        "`floor32c8` speed / `floorc8` (the fp32 masters' cost)",
        _speed(by, "floor32c8", "floorc8"),
        None,
    )
    for engine in ("zs3c-fp8", "zs3c-fp8g"):
        goal(f"`{engine}` speed / `floor32c8`", _speed(by, engine, "floor32c8"), None)
    goal("`floor8` speed / `floor` (the floor's fp8 gain)", _speed(by, "floor8", "floor"), None)
    for engine in ("fsdp2c-fp8", "fsdp2c-fp8g"):
        goal(f"`{engine}` speed / `floorc8`", _speed(by, engine, "floorc8"), None)
    for engine in ("fsdp2-fp8", "fsdp2-fp8g"):
        goal(f"`{engine}` speed / `floor8`", _speed(by, engine, "floor8"), None)
    return [
        "Goals of issue 61 (fp8; speed: tokens/s ratio, > 1 is faster; ratios of engines of "
        "this run; the gain kept is asked of the wide model, shown for every run):",
        "",
        markdown_table(["goal", "figure", "target", "status"], rows),
    ]
