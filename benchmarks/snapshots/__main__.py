"""Recovery from memory (`zeroshard.engine.Snapshots`): what snapshots cost a step, and
how long a restart from them takes.

    python -m benchmarks.snapshots --part overhead           # one GPU: GPT 1.3b, N = 1, 10
    python -m benchmarks.snapshots --part overhead --modes none,journal,dcp-async \
        --every 1 --full-every 5 --steps 10 --rounds 2       # the journal at K = 5
    python -m benchmarks.snapshots --part recovery           # CPU: 2 simulated nodes x 2
    python -m benchmarks.snapshots --smoke                   # both, tiny, CPU

`overhead` (`_overhead.py`): one rank trains the GPT and times blocks of steps with
nothing saved, with `Snapshots.take` every N-th step, and with torch DCP's `async_save`
of the same tensors every N-th step into shared memory, and `take` every step with a
gradient journal (`journal`: a full snapshot every K steps, entries between), in
alternating rounds; each snapshots row's first block (its slots' first takes) apart from
the later ones, and where its time went (`_profile.py`: host time in `take` and its
waits, the device copy and the optimizer step's stall on it, the background's checksum,
link and replication, bytes a step). `recovery`
(`_recovery.py`): two torchrun agents stand for two nodes; one is SIGKILLed with its
workers and replaced by a new one with empty memory; the time from the kill to the first
new step, split into rendezvous, setup, fetch and load, against a fresh start of the
same job. A full run writes the `snapshots_overhead` / `snapshots_recovery` sections of
docs/benchmarks.md; --smoke writes bench-out/.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from benchmarks._common import place_ranks, publish, spawn_ranks
from benchmarks.snapshots import _overhead, _recovery, _report


def parse_args() -> argparse.Namespace:
    """Command-line options."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true", help="tiny sizes on the CPU")
    p.add_argument("--part", choices=("overhead", "recovery", "all"), default="all")
    p.add_argument("--preset", default="1.3b", help="GPT preset of `overhead` (default 1.3b)")
    p.add_argument("--stage", type=int, default=2, choices=(1, 2, 3))
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=20, help="steps per block (default 20)")
    p.add_argument("--rounds", type=int, default=3, help="rounds (default 3)")
    p.add_argument("--every", default="1,10", help="N of every N-th step (default 1,10)")
    p.add_argument(
        "--modes",
        default="none,snapshot,dcp-async,journal",
        help="overhead's modes, of none,snapshot,dcp-async,journal (default all)",
    )
    p.add_argument(
        "--full-every",
        type=int,
        default=5,
        help="the journal's K: a full snapshot every K steps, entries between (default 5)",
    )
    p.add_argument(
        "--shm",
        default="/dev/shm",
        help="shared memory for overhead's snapshots and DCP's folder (default /dev/shm)",
    )
    p.add_argument("--width", type=int, default=512, help="recovery's GPT width (default 512)")
    p.add_argument("--layers", type=int, default=8, help="recovery's GPT depth (default 8)")
    return p.parse_args()


def _overhead_part(a: argparse.Namespace) -> None:
    placement = place_ranks(1, smoke=a.smoke)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "rows.json"
        every = tuple(int(n) for n in a.every.split(","))
        s = _overhead.Settings(
            preset=a.preset,
            smoke=a.smoke,
            stage=a.stage,
            micro_batch=1 if a.smoke else a.micro_batch,
            steps=4 if a.smoke else a.steps,
            warmup=1 if a.smoke else 3,
            rounds=2 if a.smoke else a.rounds,
            every=(1, 2) if a.smoke else every,
            modes=tuple(a.modes.split(",")),
            full_every=2 if a.smoke else a.full_every,
            on_gpu=placement.on_gpus,
            shm=a.shm,
            out=str(out),
        )
        spawn_ranks(_overhead.run, placement, (s,))
        rows = json.loads(out.read_text())
    shape = (
        f"GPT {'smoke' if a.smoke else a.preset}, zeroshard stage {a.stage}, one rank "
        f"({placement.describe()}), micro-batch {s.micro_batch}, blocks of {s.steps} steps"
    )
    body = _report.overhead(rows, shape)
    print(body)
    publish(
        "snapshots_overhead",
        "Snapshots: step time",
        body,
        smoke=a.smoke,
        ranks=placement.describe(),
    )


def _recovery_part(a: argparse.Namespace) -> None:
    shape = _recovery.Shape(
        width=64 if a.smoke else a.width,
        layers=1 if a.smoke else a.layers,
        seq=16 if a.smoke else 64,
        batch=4 if a.smoke else 8,
        steps=4 if a.smoke else 8,
        kill_at=2 if a.smoke else 5,
    )
    fresh, rec = [], []
    for _ in range(1 if a.smoke else a.rounds):
        with tempfile.TemporaryDirectory() as tmp:
            fresh.append(_recovery.fresh(Path(tmp), shape))
        with tempfile.TemporaryDirectory() as tmp:
            rec.append(_recovery.recovery(Path(tmp), shape))
    desc = (
        f"GPT d_model {shape.width}, {shape.layers} layers, seq {shape.seq}, global batch "
        f"{shape.batch}, zeroshard stage 3, snapshots every step; two torchrun agents "
        "(`--nnodes=2`, c10d) of 2 gloo workers each on this host, node b SIGKILLed "
        f"with its agent in step {shape.kill_at} and a new agent started at once"
    )
    body = _report.recovery(fresh, rec, desc)
    print(body)
    publish("snapshots_recovery", "Snapshots: recovery time", body, smoke=a.smoke)


def main() -> None:
    """Run the parts asked for; write their sections."""
    a = parse_args()
    if a.part in ("overhead", "all"):
        _overhead_part(a)
    if a.part in ("recovery", "all"):
        _recovery_part(a)


if __name__ == "__main__":
    main()
