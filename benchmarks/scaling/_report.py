"""The markdown of benchmarks/scaling: throughput and memory tables, goals, failures."""

from __future__ import annotations

from typing import Any

from benchmarks._common import markdown_table
from benchmarks.scaling._runs import Cell, Run, cells

SIZES = (1, 2, 4, 8)
NOT_LENT = {8: "not run: x8 not lent"}
GIB = 1024**3
# What each engine keeps allocated between steps, in bytes per parameter (psi), N ranks
# sharding (for the hybrids, N is the shard group, not the world).
KEEPS = {
    "floor": "bf16 parameters, bf16 AdamW m and v (gradients freed by zero_grad): 6 psi; "
    "8 psi during the step",
    "zs2": "bf16 parameters whole (2 psi) + fp32 master, fp32 gradient, m and v shards "
    "(16 psi / N)",
    "zs3": "fp32 master, fp32 gradient, m and v shards: 16 psi / N; bf16 parameters only "
    "while their unit is gathered",
    "fsdp2": "fp32 parameter shards, m and v: 12 psi / N (gradients freed by zero_grad); "
    "16 psi / N during the step",
    "ds3": "bf16 parameter partition (2 psi / N) on top of the fp32 master, gradient, m and "
    "v partitions, plus DeepSpeed's own buffers",
}


def _status(row: dict[str, Any]) -> str:
    if row.get("skipped"):
        return "n/a"
    error = row.get("error") or ""
    return "OOM" if "OutOfMemory" in error else "failed"


def _tps_cell(c: Cell | None, size: int) -> str:
    if c is None:
        return NOT_LENT.get(size, "not run")
    if c.tps is None:
        return _status(c.row)
    return f"{c.tps:,.0f} ({c.efficiency:.2f})" if c.efficiency else f"{c.tps:,.0f}"


def throughput_table(table: dict[str, dict[int, Cell]]) -> str:
    """tokens/s/GPU (efficiency) per engine and size."""
    header = ["engine", *(f"{n} GPU{'s' if n > 1 else ''}" for n in SIZES)]
    rows: list[list[object]] = [
        [f"`{e}`", *(_tps_cell(sizes.get(n), n) for n in SIZES)] for e, sizes in table.items()
    ]
    return markdown_table(header, rows)


def memory_table(table: dict[str, dict[int, Cell]], psi: int) -> str:
    """Peak / kept-between-steps GiB per engine and size, with the 16 psi / N bound."""
    sizes = [n for n in SIZES if any(n in s for s in table.values())]
    header = [
        "engine",
        *(f"{n} GPU{'s' if n > 1 else ''}: bound {_gib(16 * psi / n / GIB)}" for n in sizes),
    ]
    rows: list[list[object]] = []
    for engine, by in table.items():
        row: list[object] = [f"`{engine}`"]
        for n in sizes:
            c = by.get(n)
            if c is None or c.tps is None:
                row.append("-" if c is None else _status(c.row))
                continue
            peak, kept = c.row.get("peak_gib"), c.row.get("states_gib")
            row.append(f"{_gib(peak)} / {_gib(kept)}")
        rows.append(row)
    return markdown_table(header, rows)


def _gib(x: float | None) -> str:
    return "-" if x is None else f"{x:.1f}" if x >= 1 else f"{x:.3f}"


def goals(table: dict[str, dict[int, Cell]]) -> list[str]:
    """Issue 8's goals: zs3 >= 0.95 of the floor at 4 GPUs; ahead of fsdp2 and ds3 at every size."""
    zs3 = table.get("zs3", {})
    out = []
    at4 = zs3.get(4)
    if at4 is None or at4.efficiency is None:
        out.append("- `zs3` >= 0.95 of the floor's tokens/s/GPU at 4 GPUs: not measured")
    else:
        ok = "met" if at4.efficiency >= 0.95 else "NOT met"
        out.append(f"- `zs3` >= 0.95 of the floor at 4 GPUs: {at4.efficiency:.3f} ({ok})")
    for peer in ("fsdp2", "ds3"):
        parts, behind = [], []
        for n in SIZES:
            mine, theirs = zs3.get(n), table.get(peer, {}).get(n)
            if n in NOT_LENT and mine is None:
                parts.append(f"{n}: {NOT_LENT[n]}")
            elif mine and mine.tps and theirs and theirs.tps:
                parts.append(f"{n}: {mine.tps / theirs.tps:.3f}x")
                behind += [n] if mine.tps <= theirs.tps else []
            elif mine or theirs:
                parts.append(f"{n}: not compared (`zs3` or `{peer}` not measured)")
        compared = [p for p in parts if p.endswith("x")]
        verdict = "NOT met at " + ", ".join(map(str, behind)) if behind else "met where measured"
        out.append(
            f"- `zs3` ahead of `{peer}` at every size (speed ratio): {'; '.join(parts)} "
            f"({verdict if compared else 'not measured'})"
        )
    return out


def failures(table: dict[str, dict[int, Cell]]) -> list[str]:
    """One line per failed engine and size, with the error."""
    return [
        f"- `{engine}` at {n} GPU(s): {c.row['error']}"
        for engine, by in table.items()
        for n, c in sorted(by.items())
        if c.row.get("error")
    ]


def section(
    grouped: dict[str, dict[int, list[Run]]],
) -> tuple[str, dict[str, dict[str, dict[int, Cell]]]]:
    """The markdown body and the cells per model (for the plot)."""
    runs = [r for by in grouped.values() for rs in by.values() for r in rs]
    first = runs[0].meta
    devices = sorted({f"{r.meta.get('device')} (torch {r.meta.get('torch')})" for r in runs})
    body = [
        f"From {len(runs)} runs of `benchmarks/train_step` on {', '.join(devices)}: "
        + ", ".join(f"`{r.path.name}`" for r in runs)
        + ". Each row: tokens/s/GPU (scaling efficiency = that / the floor's tokens/s, the "
        "same model on one GPU with no communication, measured in the same run). The "
        "hybrid engines shard within "
        f"{first.get('shard_group_size', 2)} ranks and replicate across the rest; `n/a`: "
        "the hybrid does not apply at that size. Memory: `peak / kept` GiB, peak = "
        "torch.cuda.max_memory_allocated from wrapping to the last step, kept = allocated "
        "between steps (the model states), largest rank; the bound is 16 psi / N (bf16 "
        "parameters and gradients, fp32 master, m and v: 2 + 2 + 12 bytes per parameter, "
        "sharded over N, the ZeRO paper's model states).",
        "",
        "What each engine keeps between steps (psi parameters, N ranks sharding):",
        "",
        *(f"- `{e}`: {what}" for e, what in KEEPS.items()),
        "- hybrids (`zs2h`, `zs3h`, `fsdp2h`): as their base engine with N the shard group.",
    ]
    all_cells = {}
    for model, by_world in grouped.items():
        table = cells(by_world)
        all_cells[model] = table
        psi = next(r for rs in by_world.values() for r in rs).meta["parameters"]
        cmds = sorted({f"`{r.meta.get('command')}`" for rs in by_world.values() for r in rs})
        body += [
            "",
            f"### {model}",
            "",
            "Commands: " + ", ".join(cmds) + ".",
            "",
            "tokens/s/GPU (efficiency against the floor):",
            "",
            throughput_table(table),
            "",
            "Goals (issue 8):",
            "",
            *goals(table),
            "",
            "Memory, peak / kept GiB (bound: 16 psi / N GiB):",
            "",
            memory_table(table, psi),
        ]
        fails = failures(table)
        if fails:
            body += ["", "Failures:", "", *fails]
    return "\n".join(body), all_cells
