"""Scaling report: tokens/s/GPU, efficiency against the floor and memory, from train_step runs.

    python -m benchmarks.scaling                      # every benchmarks/results/*.json
    python -m benchmarks.scaling bench-out/a.json bench-out/b.json

Each input is the bench-out/<section>.json of one benchmarks/train_step run (one model,
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
from pathlib import Path

from benchmarks._common import RESULTS, ROOT, SMOKE_OUT, publish
from benchmarks.scaling._plot import plot
from benchmarks.scaling._report import section
from benchmarks.scaling._runs import group, load

PNG = ROOT / "docs" / "scaling.png"


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
        f"Built {datetime.date.today().isoformat()} by `benchmarks.scaling` from the runs listed "
        "below (their device, versions and commands are in each JSON file and below)."
    )
    publish("scaling", "Scaling: 1, 2, 4 and 8 GPUs", body, smoke=smoke, measured=measured)


if __name__ == "__main__":
    main()
