"""The same benchmark on the code before and after a change, in one run on one machine.

    python -m benchmarks.before_after --before OLD_TREE --name arch --rounds 3 -- \
        torchrun --standalone --nproc-per-node=1 -m benchmarks.train_step \
        --engines floor32,zs2,zs3,zs3c --no-write
    python -m benchmarks.before_after --before OLD_TREE --name arch_offload --rounds 3 \
        --json bench-out/offload.json -- python -m benchmarks.offload --parts train-zs \
            --json bench-out/offload.json --no-write

`OLD_TREE` is a checkout of the earlier commit (`git worktree add OLD_TREE COMMIT`). The
command runs once per round on each tree, in alternating order (before then after in odd
rounds, after then before in even ones), with `PYTHONPATH` pointing at that tree's
`packages/*/src`: the benchmark's own code is this checkout's, the zeroshard it imports
the tree's. Each run's rows are read from the JSON it writes (`--json`: train_step's
`bench-out/<section>.json` by default, whose `results` rows have an `engine` and a
`step_ms`; or the offload benchmark's `--json` file, a part -> row map with `step_s`).
The report gives per row the median step of each tree over the rounds (every round's
beside it) and after / before: a row that does not change with the code (a floor that
imports no zeroshard) shows the run's own spread. A full run writes the section
"before_after_<name>" of docs/benchmarks.md; --smoke writes bench-out/.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

from benchmarks._common import ROOT, markdown_table, publish

TREES = ("before", "after")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The options before `--`, and the benchmark command after it."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--before", type=Path, required=True, help="the earlier checkout's root")
    p.add_argument("--after", type=Path, default=ROOT, help="default: this checkout")
    p.add_argument("--before-commit", default=None, help="the commit BEFORE holds (report)")
    p.add_argument("--name", required=True, help="section before_after_NAME")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json", type=Path, default=None, help="the JSON each run writes")
    p.add_argument("--smoke", action="store_true", help="write bench-out/, not the docs")
    p.add_argument("command", nargs=argparse.REMAINDER)
    args = p.parse_args(argv)
    if args.command[:1] == ["--"]:
        args.command = args.command[1:]
    if not args.command:
        p.error("give the benchmark command after --")
    return args


def _pythonpath(tree: Path) -> str:
    """`tree`'s package sources, then this checkout (the benchmarks' own code), then what
    `PYTHONPATH` held (packages installed beside them)."""
    srcs = sorted(str(p) for p in (tree / "packages").glob("*/src"))
    if not srcs:
        raise SystemExit(f"{tree} has no packages/*/src: is it a zeroshard checkout?")
    return os.pathsep.join([*srcs, str(ROOT), os.environ.get("PYTHONPATH", "")])


def rows_of(data: Any) -> dict[str, float]:
    """Step seconds by row of one run's JSON: train_step's (`results`, each with `engine`
    and `step_ms`) or offload's (part -> row with `step_s`); failed rows left out."""
    if isinstance(data, dict) and "results" in data:
        return {
            r["engine"]: r["step_ms"] / 1000
            for r in data["results"]
            if r.get("step_ms") is not None
        }
    return {
        part: r["step_s"]
        for part, r in data.items()
        if isinstance(r, dict) and r.get("step_s") is not None
    }


def _json_path(args: argparse.Namespace) -> Path:
    if args.json is not None:
        return args.json
    section = next(
        (args.command[i + 1] for i, a in enumerate(args.command[:-1]) if a == "--section"),
        "train_step",
    )
    return ROOT / "bench-out" / f"{section}.json"


def run(args: argparse.Namespace) -> dict[str, dict[str, list[float]]]:
    """Every round's step seconds, by tree then row."""
    out: dict[str, dict[str, list[float]]] = {t: {} for t in TREES}
    path = _json_path(args)
    for r in range(args.rounds):
        order = TREES if r % 2 == 0 else TREES[::-1]
        for tree in order:
            root = args.before if tree == "before" else args.after
            env = {**os.environ, "PYTHONPATH": _pythonpath(root.resolve())}
            path.unlink(missing_ok=True)
            print(f"[before_after] round {r + 1}, {tree}: {shlex.join(args.command)}", flush=True)
            subprocess.run(args.command, cwd=ROOT, env=env, check=True)
            rows = rows_of(json.loads(path.read_text()))
            # Each run's rows as it ends: a run cut short by a time limit keeps these.
            print(f"[before_after] round {r + 1}, {tree}: {json.dumps(rows)}", flush=True)
            for row, seconds in rows.items():
                out[tree].setdefault(row, []).append(seconds)
    return out


def report(args: argparse.Namespace, steps: dict[str, dict[str, list[float]]]) -> str:
    """One row per benchmark row: each tree's median step (its rounds in brackets, in the
    order run) and after / before."""
    rows = []
    names = list(dict.fromkeys([*steps["before"], *steps["after"]]))
    for name in names:
        before, after = steps["before"].get(name, []), steps["after"].get(name, [])
        cells = [name]
        for s in (before, after):
            each = ", ".join(f"{x * 1000:.1f}" for x in s)
            cells.append(f"{statistics.median(s) * 1000:.1f} [{each}]" if s else "failed")
        ratio = statistics.median(after) / statistics.median(before) if before and after else None
        cells.append(f"{ratio:.3f}" if ratio is not None else "-")
        rows.append(cells)
    header = ["row", "before: ms (rounds)", "after: ms (rounds)", "after / before"]
    return (
        f"Command (each tree, {args.rounds} rounds, alternating): "
        f"`{shlex.join(args.command)}`. Before: {args.before_commit or _commit(args.before)}; "
        f"after: "
        f"{_commit(args.after)}.\n\n" + markdown_table(header, rows)
    )


def _commit(tree: Path) -> str:
    """`tree`'s commit, or its path where it is no git checkout."""
    found = subprocess.run(
        ["git", "-C", str(tree), "rev-parse", "--short=12", "HEAD"],
        capture_output=True,
        text=True,
    )
    return found.stdout.strip() if found.returncode == 0 else str(tree)


def main() -> None:
    """Run the rounds, print and publish the report."""
    args = parse_args(sys.argv[1:])
    body = report(args, run(args))
    print(body)
    publish(f"before_after_{args.name}", f"Before and after ({args.name})", body, smoke=args.smoke)


if __name__ == "__main__":
    main()
