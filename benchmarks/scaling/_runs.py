"""The runs benchmarks/scaling reads: train_step's JSON files, grouped per model and size."""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Run:
    """One train_step run: its settings and one row per engine."""

    path: Path
    meta: dict[str, Any]
    rows: dict[str, dict[str, Any]]

    @property
    def model(self) -> str:
        """The model key: runs with the same key are comparable."""
        m = self.meta
        ac = ", activation checkpointing" if m["activation_checkpointing"] else ""
        return (
            f"{m['model_name']} `{m['preset']}` ({count(m['parameters'])} parameters), "
            f"seq {m['seq_len']}, "
            f"micro-batch {m['micro_batch']}, {m['dtype']}{ac}"
        )

    @property
    def world(self) -> int:
        """GPUs (ranks) of the run."""
        return int(self.meta["world"])


def count(n: int) -> str:
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
        raise SystemExit(f"{path}: not a train_step results file ({type(e).__name__}: {e})") from e


def group(runs: list[Run]) -> dict[str, dict[int, list[Run]]]:
    """Runs per model and world size; two runs may share a size if their engines differ
    (each may have its own floor)."""
    out: dict[str, dict[int, list[Run]]] = {}
    for run in runs:
        same = out.setdefault(run.model, {}).setdefault(run.world, [])
        mine = {e for e, row in run.rows.items() if measured(row) and e != "floor"}
        for other in same:
            both = {e for e in mine if e in other.rows and measured(other.rows[e])}
            if both:
                raise SystemExit(
                    f"{other.path} and {run.path} both measured {sorted(both)} for "
                    f"{run.model} at {run.world} GPUs: pass one of them"
                )
        same.append(run)
    return out


def measured(row: dict[str, Any]) -> bool:
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
        if "floor" in r.rows and measured(r.rows["floor"])
    ]
    fallback = statistics.median(floors) if floors else None
    out: dict[str, dict[int, Cell]] = {}
    for world, runs in sorted(by_world.items()):
        for run in runs:
            own = run.rows.get("floor")
            floor = own["tokens_per_s_per_gpu"] if own and measured(own) else fallback
            for engine, row in run.rows.items():
                have = out.setdefault(engine, {}).get(world)
                if have is None or not measured(have.row):
                    out[engine][world] = Cell(row, run, floor)
    return out
