"""Scaling report: tokens/s/GPU, efficiency against the floor and memory, from train_step runs.

    python -m benchmarks.scaling                      # every benchmarks/results/*.json
    python -m benchmarks.scaling bench-out/a.json bench-out/b.json

Each input is the bench-out/<section>.json of one benchmarks/train_step.py run (one model,
one world size). Runs of the same model (preset, sequence, micro-batch, dtype, activation
checkpointing) at 1, 2, 4 and 8 GPUs become one table: tokens/s/GPU per engine and size,
and the scaling efficiency = engine tokens/s/GPU / the floor's tokens/s (the model on one
GPU with no communication, measured in the same run; the median of the model's floors
when that run has none). Then the goals of issue 8 and a peak-memory table against the
analytic 16 psi / N bound. Writes section "scaling" of docs/benchmarks.md and
docs/scaling.png; inputs from `--smoke` runs (CPU) write only bench-out/scaling.md and
bench-out/scaling.png.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks._report import SMOKE_OUT, markdown_table, publish
from benchmarks._scaling_plot import plot

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
PNG = ROOT / "docs" / "scaling.png"
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


@dataclass(frozen=True)
class Run:
    """One train_step.py run: its settings and one row per engine."""

    path: Path
    meta: dict[str, Any]
    rows: dict[str, dict[str, Any]]

    @property
    def model(self) -> str:
        """The model key: runs with the same key are comparable."""
        m = self.meta
        ac = ", activation checkpointing" if m["activation_checkpointing"] else ""
        return (
            f"{m['model_name']} `{m['preset']}` ({_count(m['parameters'])} parameters), "
            f"seq {m['seq_len']}, "
            f"micro-batch {m['micro_batch']}, {m['dtype']}{ac}"
        )

    @property
    def world(self) -> int:
        """GPUs (ranks) of the run."""
        return int(self.meta["world"])


def _count(n: int) -> str:
    return f"{n / 1e9:.2f} B" if n >= 1e8 else f"{n / 1e6:.2f} M"


def load(path: Path) -> Run:
    """Read one bench-out/<section>.json; a clear error if it is not one."""
    try:
        data = json.loads(path.read_text())
        meta, rows = data["meta"], data["results"]
        missing = [
            k
            for k in ("preset", "parameters", "world", "micro_batch", "seq_len", "dtype")
            if k not in meta
        ]
        if missing:
            raise KeyError(f"meta has no {missing}")
        meta.setdefault("activation_checkpointing", False)
        meta.setdefault("model_name", "gpt")  # runs from before `--model` existed
        return Run(path, meta, {r["engine"]: r for r in rows})
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise SystemExit(
            f"{path}: not a train_step.py results file ({type(e).__name__}: {e})"
        ) from e


def group(runs: list[Run]) -> dict[str, dict[int, list[Run]]]:
    """Runs per model and world size; two runs may share a size if their engines differ
    (each may have its own floor)."""
    out: dict[str, dict[int, list[Run]]] = {}
    for run in runs:
        same = out.setdefault(run.model, {}).setdefault(run.world, [])
        mine = {e for e, row in run.rows.items() if _measured(row) and e != "floor"}
        for other in same:
            both = {e for e in mine if e in other.rows and _measured(other.rows[e])}
            if both:
                raise SystemExit(
                    f"{other.path} and {run.path} both measured {sorted(both)} for "
                    f"{run.model} at {run.world} GPUs: pass one of them"
                )
        same.append(run)
    return out


def _measured(row: dict[str, Any]) -> bool:
    return row.get("tokens_per_s_per_gpu") is not None


@dataclass(frozen=True)
class Cell:
    """One engine at one size: its row, its run and the floor it is compared with."""

    row: dict[str, Any]
    run: Run
    floor_tps: float | None

    @property
    def tps(self) -> float | None:
        """Tokens/s/GPU, None if not measured."""
        v = self.row.get("tokens_per_s_per_gpu")
        return float(v) if v is not None else None

    @property
    def efficiency(self) -> float | None:
        """tokens/s/GPU over the floor's tokens/s."""
        return self.tps / self.floor_tps if self.tps and self.floor_tps else None


def cells(by_world: dict[int, list[Run]]) -> dict[str, dict[int, Cell]]:
    """engine -> size -> Cell, for one model; a measured row wins over a failed one."""
    floors = [
        r.rows["floor"]["tokens_per_s_per_gpu"]
        for runs in by_world.values()
        for r in runs
        if "floor" in r.rows and _measured(r.rows["floor"])
    ]
    fallback = statistics.median(floors) if floors else None
    out: dict[str, dict[int, Cell]] = {}
    for world, runs in sorted(by_world.items()):
        for run in runs:
            own = run.rows.get("floor")
            floor = own["tokens_per_s_per_gpu"] if own and _measured(own) else fallback
            for engine, row in run.rows.items():
                have = out.setdefault(engine, {}).get(world)
                if have is None or not _measured(have.row):
                    out[engine][world] = Cell(row, run, floor)
    return out


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
        f"From {len(runs)} runs of `benchmarks/train_step.py` on {', '.join(devices)}: "
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


def main() -> None:
    """Read the runs, write the section and the plot."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("files", nargs="*", type=Path, help="default: benchmarks/results/*.json")
    args = p.parse_args()
    files = args.files or sorted(RESULTS.glob("*.json"))
    if not files:
        raise SystemExit(f"no results: pass JSON files or commit them under {RESULTS}")
    runs = [load(f) for f in files]
    smoke = any(r.meta["preset"] == "smoke" or r.meta.get("device") == "cpu" for r in runs)
    body, all_cells = section(group(runs))
    png = SMOKE_OUT / "scaling.png" if smoke else PNG
    if plot(all_cells, png) and not smoke:
        body += f"\n\n![tokens/s/GPU against GPUs per engine]({png.name})"
    print(body)
    measured = (
        f"Built {datetime.date.today().isoformat()} by `scaling.py` from the runs listed "
        "below (their device, versions and commands are in each JSON file and below)."
    )
    publish("scaling", "Scaling: 1, 2, 4 and 8 GPUs", body, smoke=smoke, measured=measured)


if __name__ == "__main__":
    main()
