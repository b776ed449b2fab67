"""Time a bf16-mixed Lightning fit of the 1.3B GPT with zeroshard_stage_3 against the same
model's zs3 step as benchmarks/train_step times it, on one GPU, in one process.

    python -m benchmarks.lightning              # one GPU; writes the "lightning" section
    python -m benchmarks.lightning --smoke      # CPU, train_step's smoke GPT, bench-out/ only

The runs (`_runs.py`): `lightning` (the Trainer with the strategy), `zs3` (the engine's
plain loop), each `--rounds` times in alternating order on a model built afresh, then
`single` (Lightning's own single-device run of the same model at the same precision), for
its loss. The report (`_report.py`): the median step of each run with issue 63's goal (the
fit within 2% of the zs3 step: the strategy adds nothing of its own), and every step's
loss of the three. Full runs write the "lightning" section of docs/benchmarks.md;
`--smoke` and `--no-write` write bench-out/lightning.md.
"""

from __future__ import annotations

import argparse
import os
import warnings

import torch
import torch.distributed as dist

from benchmarks._common import bench_model, join, place_ranks, publish
from benchmarks.lightning._report import report
from benchmarks.lightning._runs import Precision, Run, fit, zs3_steps

PRECISIONS = {"bf16-mixed": "bf16", "32-true": "fp32"}


def parse_args() -> argparse.Namespace:
    """Command-line options."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="1.3b", help="examples/gpt.py preset (default 1.3b)")
    p.add_argument("--micro-batch", type=int, default=8, help="sequences per step (default 8)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps per run")
    p.add_argument("--steps", type=int, default=8, help="timed steps per run")
    p.add_argument("--rounds", type=int, default=2, help="rounds of both runs, alternating")
    p.add_argument("--smoke", action="store_true", help="CPU, tiny GPT, fp32, bench-out only")
    p.add_argument("--no-write", action="store_true", help="write bench-out/ only")
    args = p.parse_args()
    if args.smoke:
        args.micro_batch, args.warmup, args.steps = 2, 1, 2
    if min(args.rounds, args.steps, args.micro_batch) < 1 or args.warmup < 0:
        p.error("--rounds, --steps and --micro-batch must be positive, --warmup >= 0")
    return args


def main() -> None:
    """Run the rounds, then the single-device run, and publish the report."""
    args = parse_args()
    # The Trainer runs in a job of one rank started here: it finds the process group.
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29531")
    warnings.filterwarnings("ignore", module="lightning")
    placement = place_ranks(1, smoke=args.smoke)
    device = join(placement)
    print(f"[lightning] ranks: {placement.describe()}", flush=True)
    precision: Precision = "32-true" if args.smoke else "bf16-mixed"
    bm = bench_model(
        "gpt", args.preset, smoke=args.smoke, seq_len=None, activation_checkpointing=False
    )
    g = torch.Generator().manual_seed(1234)
    tokens = torch.randint(0, bm.vocab_size, (args.micro_batch, bm.seq_len + 1), generator=g)
    batch = (tokens[:, :-1].to(device), tokens[:, 1:].to(device))
    counts = {"warmup": args.warmup, "steps": args.steps}
    runs = {
        "lightning": lambda: fit(
            "lightning", "zeroshard_stage_3", bm, batch, device, precision=precision, **counts
        ),
        "zs3": lambda: zs3_steps(bm, batch, device, compute_dtype=PRECISIONS[precision], **counts),
    }
    rounds: dict[str, list[Run]] = {name: [] for name in runs}
    for index in range(args.rounds):
        for name in list(runs) if index % 2 == 0 else list(runs)[::-1]:
            run = runs[name]()
            rounds[name].append(run)
            print(
                f"[lightning] {name} (round {index + 1}): {run.median_ms:.1f} ms/step", flush=True
            )
    single = fit("single", "auto", bm, batch, device, precision=precision, **counts)
    body = report(
        bm, rounds, single, precision=precision, micro_batch=args.micro_batch, warmup=args.warmup
    )
    print(body)
    title = "Lightning Trainer on zeroshard stage 3 vs the zs3 step (one GPU)"
    publish("lightning", title, body, smoke=args.smoke or args.no_write, ranks=placement.describe())
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
