"""CPU offload on one GPU: the step against its parts, DeepSpeed, the largest model.

    python -m benchmarks.offload                 # one GPU (H100 80 GB, 128 GiB host)
    python -m benchmarks.offload --smoke         # tiny model on the CPU, gloo
    python -m benchmarks.offload --rounds 3      # train rows: median of 3 rounds
    python -m benchmarks.offload --search-layers 40,48,56 --stage 3 --offload-params
    python -m benchmarks.offload --parts train-zs-overlap,train-zs-overlap-bf16,train-ds-bf16
    python -m benchmarks.offload --search-layers 102,103,104 --stage 3 --offload-params \
        --search-part train-zs-overlap-bf16 --warmup 1 --steps 3 --budget-s 480

Training rows: zeroshard with `offload_optimizer` (stage 2 by default) stepping the CPU
inside backward (`train-zs-overlap`, `step_in_backward`), the same with only
`--offload-ratio` of the masters and optimizer state on the host and the rest stepped on
the device (`train-zs-ratio`), beside the next forward and backward with the weights one
step behind (`train-zs-dpu`, `offload_delay_param_update`, stages 1/2), after backward
(`train-zs`) and after clipping the gradients to a global norm (`train-zs-clip`), and
DeepSpeed ZeRO-Offload (the same stage, `offload_optimizer: cpu`, DeepSpeedCPUAdam) on the
same GPT (the 7b preset's width with `--layers` blocks: 34 give 7.06B parameters), bf16
compute, AdamW, the same random tokens. Per row: step time (median after warmup), tokens/s,
peak GPU memory, peak host RSS and init time. Beside the step, each of its resources alone,
in the same run: the GPU's forward and backward without optimizer or offload (`fwd-bwd`),
the bus's copies of every parameter (`transfer`: down in bf16, up in fp32, or bf16 with
`--offload-params`), and the CPU's AdamW over as many parameters (torch fused, measured
over `--adam-params` and scaled to the model's count); the report gives step / max of the
three, and the host memory's streaming rate (`host-stream`: c = a + b over fp32, every
core) with what the CPU's AdamW and the bus's copies need of it: both go through host
memory. CPU optimizer rows: parameters/s of one AdamW step over `--adam-params` fp32
parameters in tensors of `--chunk` elements, with every core: torch's fused and foreach
AdamW and DeepSpeedCPUAdam, whose extension `ds-build` builds first, an untimed part
(outside `--budget-s`), and zeroshard's offloaded step alone (`adam-zs-host`: bf16
gradients in, fused AdamW, the fp32 masters up to be cast on the device, no forward or
backward) over as many parameters. A zeroshard part named with `-compiled` after it
(`train-zs-dpu-compiled`, `adam-zs-host-compiled`, ...) is the same with
`offload_compiled_step`, so both run, alternated, in one run; one named with `-bf16` after
it (`train-zs-bf16`, `train-zs-overlap-bf16`, `adam-zs-host-bf16`, ...) is the same with
bf16 masters (`precision.master_dtype`: the masters and AdamW's moments bf16 on the host),
and `train-ds-bf16` is DeepSpeed's closest setting (`bf16_master_weights_and_grads` with
`bf16_optimizer_states`: DeepSpeedCPUAdam's moments bf16 too). Where a run has a `-bf16`
row, the report gives each row's host bytes a parameter (its peak RSS, and zeroshard's own
count of what its offload holds: buffers and optimizer state) and, for each `-bf16` row
against its fp32 twin and the DeepSpeed rows, issue 73's goals (want 3), met or missed by
the run's figures. Every part runs in a process
of its own under a time limit, so an out-of-memory (host or GPU), a failed JIT build or a
timeout becomes a row saying so. `--rounds R` runs the `train-*` parts and
`adam-torch-fused` R times, each time in a process of its own, in alternating order (as
listed in `--parts` in the first round, reversed in the second, ...); the other parts run
once, in the first round where `--parts` lists them. The CPU AdamW's rate is the median of
its rounds, each round's given beside it. A train row's step is the median of its rounds'
(each a median of `--steps`), with every round's in brackets in the order run and the
fastest and slowest single step of any round after them; tokens/s from it, the largest
peaks and the median init; a part that fails is not run again and its row is the first
failure. `--budget-s` covers every round: runs it has no time for become skipped rows, or a
count of skipped rounds beside a row's done ones. `--search-layers` instead trains
zeroshard alone at each block count in turn, up to the first that fails: the largest that
trains, with its peaks (`--search-part` names the part it trains, `train-zs-overlap` by
default), each size beside what `zeroshard.engine.estimate` (the planner behind
`zeroshard-plan`) predicts for the same model and config, run in this process. A full run
writes the "offload" section of docs/benchmarks.md (a search writes
"offload-largest-stage<N>", "-bf16" after it for a `-bf16` part); --smoke writes bench-out/.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks._common import place_ranks, publish
from benchmarks.offload._bf16 import BF16
from benchmarks.offload._plan import predict
from benchmarks.offload._report import report
from benchmarks.offload._rounds import (
    CPU_RESOURCE,
    SKIPPED,
    combine,
    combine_rate,
    is_train,
    runs_every_round,
    schedule,
)

WORKER = "benchmarks.offload._worker"  # run with -m from the repository root


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options (`argv`, else the command line's)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true", help="tiny model on the CPU")
    p.add_argument(
        "--parts",
        default=(
            "fwd-bwd,transfer,host-stream,adam-torch-fused,adam-zs-host,train-zs-overlap,train-zs-dpu,"
            "train-zs,train-zs-clip,ds-build,adam-ds,train-ds"
        ),
    )
    p.add_argument("--preset", default="7b")
    p.add_argument("--layers", type=int, default=34, help="blocks (34 x 7b width: 7.07B)")
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument(
        "--activation-checkpointing",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="recompute each block in backward, in both engines (default on)",
    )
    p.add_argument("--stage", type=int, default=2, choices=(1, 2, 3))
    p.add_argument("--offload-params", action="store_true", help="stage 3: parameters too")
    p.add_argument(
        "--offload-ratio",
        type=float,
        default=0.7,
        help="train-zs-ratio: the share of masters and optimizer state on the host",
    )
    p.add_argument("--search-layers", default="", help="e.g. 40,48,56: largest that trains")
    p.add_argument(
        "--search-part",
        default=None,
        help="the zeroshard train part --search-layers trains (default train-zs-overlap)",
    )
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--adam-params", type=int, default=10**9)
    p.add_argument("--chunk", type=int, default=32 * 2**20, help="elements per CPU tensor")
    p.add_argument("--adam-steps", type=int, default=3)
    p.add_argument("--section", default="", help="docs/benchmarks.md section to write")
    p.add_argument("--json", type=Path, default=None, help="also write the rows here (JSON)")
    p.add_argument("--no-write", action="store_true", help="print the table, write no docs")
    p.add_argument("--budget-s", type=float, default=450.0, help="wall time for all parts")
    p.add_argument(
        "--rounds", type=int, default=1, help="runs of each train part, in alternating order"
    )
    args = p.parse_args(argv)
    if args.rounds < 1:
        p.error(f"--rounds must be at least 1, not {args.rounds}")
    if args.rounds > 1 and args.search_layers:
        p.error("--rounds repeats the train parts; --search-layers trains each size once")
    if not 0 < args.offload_ratio < 1:
        p.error(f"--offload-ratio must be in (0, 1), not {args.offload_ratio}")
    if args.offload_params and args.stage != 3:
        p.error("--offload-params needs --stage 3")
    if args.search_part is not None and not args.search_layers:
        p.error("--search-part names the part --search-layers trains; give --search-layers")
    args.search_part = args.search_part or "train-zs-overlap"
    if args.search_part not in LIMITS or not args.search_part.startswith("train-zs"):
        p.error(f"--search-part must be a zeroshard train part, not {args.search_part!r}")
    if args.stage == 3:
        # delay_param_update is for stages 1/2 (the next forward gathers what it rewrites).
        args.parts = ",".join(x for x in args.parts.split(",") if "train-zs-dpu" not in x)
    if not args.section:
        bf16 = "-bf16" if args.search_part.endswith(BF16) else ""
        largest = f"offload-largest-stage{args.stage}{bf16}"
        args.section = largest if args.search_layers else "offload"
    if args.smoke:
        args.preset, args.layers, args.seq_len, args.micro_batch = "tiny", 2, 64, 2
        args.adam_params, args.chunk, args.adam_steps, args.steps = 2 * 10**6, 2**19, 2, 2
    return args


# Seconds each part may take at most (the run's budget shrinks them when it runs short).
LIMITS = {
    "fwd-bwd": 60.0,
    # Pins a bf16, then an fp32 copy of every parameter first (42 GB at 7.06B): 37 s on
    # one H200 host, past 40 s in the run after it.
    "transfer": 90.0,
    "host-stream": 40.0,
    "adam-torch-fused": 40.0,
    "adam-torch-foreach": 30.0,
    "adam-zs-host": 120.0,
    "train-zs-overlap": 110.0,
    "train-zs-ratio": 110.0,
    "train-zs-dpu": 100.0,
    "train-zs": 100.0,
    "train-zs-clip": 100.0,
    # The zeroshard rows with offload_compiled_step: one compile of the step's kernels in
    # initialize (40-70 s a process on the H200 hosts, with a warm inductor cache too).
    "adam-zs-host-compiled": 150.0,
    "train-zs-overlap-compiled": 180.0,
    "train-zs-ratio-compiled": 180.0,
    "train-zs-dpu-compiled": 180.0,
    "train-zs-compiled": 180.0,
    "train-zs-clip-compiled": 180.0,
    # DeepSpeedCPUAdam's extension (ninja, cached): built here, outside the budget, so
    # that the parts after it time steps only.
    "ds-build": 300.0,
    "adam-ds": 40.0,
    "train-ds": 150.0,
}
# The same parts with bf16 masters take as long at most, compiled or not.
_BF16_TWINS = ("adam-zs-host", "train-zs-overlap", "train-zs-ratio", "train-zs-dpu", "train-zs")
_COMPILED = [f"{p}-compiled" for p in (*_BF16_TWINS, "train-zs-clip")]
LIMITS |= {f"{p}{BF16}": LIMITS[p] for p in (*_BF16_TWINS, *_COMPILED, "train-zs-clip", "train-ds")}
UNTIMED = {"ds-build"}


def run_part(part: str, args: dict[str, Any], limit: float) -> dict[str, Any]:
    """Run one part in its own process; a crash, a kill or a timeout becomes an error row."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        start = time.perf_counter()
        try:
            proc = subprocess.run(
                [sys.executable, "-m", WORKER, part, json.dumps(args), str(out)],
                capture_output=True,
                text=True,
                timeout=limit,
            )
        except subprocess.TimeoutExpired:
            return {"ok": False, "error": f"did not finish within {limit:.0f}s", "wall_s": limit}
        wall = time.perf_counter() - start
        if out.exists():
            result: dict[str, Any] = json.loads(out.read_text())
        else:
            # Killed from outside (the kernel's OOM killer sends SIGKILL: rc -9).
            why = "killed (host out of memory?)" if proc.returncode == -9 else "crashed"
            tail = (proc.stderr or "").strip().splitlines()[-1:] or [""]
            result = {"ok": False, "error": f"{why}, rc {proc.returncode}: {tail[0][:160]}"}
        result["wall_s"] = wall
        if not result["ok"]:
            print(f"{part}: {result['error']}\n{result.get('trace', '')}", file=sys.stderr)
        return result


def _shown(result: dict[str, Any]) -> str:
    """A part's result as one line of JSON, without the trace (stderr has it)."""
    return json.dumps({k: v for k, v in result.items() if k != "trace"})


def _limit(part: str, left: float, smoke: bool) -> float:
    # Smoke runs on a shared CPU: DeepSpeed's JIT build may not finish there at all.
    cap = min(LIMITS[part], 60.0) if smoke else LIMITS[part]
    return cap if part in UNTIMED else min(cap, left)


def run_parts(args: argparse.Namespace, shared: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Each part of `--parts` in order, then the further rounds of the parts that run every
    round, all within the budget (untimed parts outside it); their rows from their rounds."""
    parts = args.parts.split(",")
    for part in parts:
        if part not in LIMITS:
            raise SystemExit(f"unknown part {part!r}; valid: {', '.join(LIMITS)}")
        if parts.count(part) > 1:
            raise SystemExit(f"--parts lists {part!r} twice; --rounds repeats train parts")
    spent = 0.0
    runs: dict[str, list[dict[str, Any]]] = {}
    for part, index in schedule(parts, args.rounds):
        ran = runs.setdefault(part, [])
        if any(not r["ok"] and r["error"] != SKIPPED for r in ran):
            continue  # failed in an earlier round: its row is that failure, not a median
        left = args.budget_s - spent
        if left < 10 and part not in UNTIMED:
            ran.append({"ok": False, "error": SKIPPED, "wall_s": 0.0})
            continue
        ran.append(run_part(part, shared, _limit(part, left, args.smoke)))
        if part not in UNTIMED:
            spent += ran[-1]["wall_s"]
        again = args.rounds > 1 and runs_every_round(part)
        where = f" (round {index + 1}/{args.rounds})" if again else ""
        print(f"{part}{where}: {_shown(ran[-1])}", flush=True)
    tokens = args.micro_batch * args.seq_len
    rows = {}
    for p, rs in runs.items():
        if is_train(p):
            rows[p] = combine(rs, args.rounds, tokens)
        else:
            rows[p] = combine_rate(rs, args.rounds) if p == CPU_RESOURCE else rs[0]
    return rows


def search(args: argparse.Namespace, shared: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """zeroshard alone (`--search-part`) at each block count of `--search-layers`, up to
    the first failure; each size that ran with the planner's prediction beside it."""
    results: dict[str, dict[str, Any]] = {}
    deadline = time.perf_counter() + args.budget_s
    part = args.search_part
    for layers in sorted(int(x) for x in args.search_layers.split(",")):
        left = deadline - time.perf_counter()
        if left < 10:
            results[f"{part}@{layers}"] = {"ok": False, "error": SKIPPED}
            break
        r = run_part(part, {**shared, "layers": layers}, min(left, 200.0))
        # After the run, so that the planner's few seconds on the meta device are not
        # charged to the part's time limit; they are to the budget.
        try:
            r["plan"] = predict({**shared, "layers": layers}, part)
        except Exception as e:  # the measured row is kept; the planner's failure beside it
            r["plan"] = {"error": f"{type(e).__name__}: {e}".splitlines()[0][:160]}
        results[f"{part}@{layers}"] = r
        print(f"{layers} blocks: {_shown(r)}", flush=True)
        if not r["ok"]:
            break
    return results


def main() -> None:
    """Run the parts in order within the budget; write the report."""
    args = parse_args()
    shared = {
        k: getattr(args, k)
        for k in (
            "preset",
            "layers",
            "seq_len",
            "micro_batch",
            "stage",
            "warmup",
            "steps",
            "adam_params",
            "chunk",
            "adam_steps",
            "activation_checkpointing",
            "offload_params",
            "offload_ratio",
            "smoke",
        )
    }
    placement = place_ranks(1, smoke=args.smoke)  # what each part's process joins as
    print(f"[offload] ranks: {placement.describe()}", flush=True)
    results = search(args, shared) if args.search_layers else run_parts(args, shared)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=1))
    body = report(args, results)
    print(body)
    if args.no_write:
        return
    title = "CPU offload (one GPU)" + (f" ({args.section})" if args.section != "offload" else "")
    publish(args.section, title, body, smoke=args.smoke, ranks=placement.describe())


if __name__ == "__main__":
    main()
