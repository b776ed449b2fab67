"""The largest GPT one GPU trains with optimizer offload, and CPU AdamW throughput.

    python -m benchmarks.offload                 # one GPU (H100 80 GB, 128 GiB host)
    python -m benchmarks.offload --smoke         # tiny model on the CPU, gloo

Training rows: zeroshard with `offload_optimizer` (stage 2 by default) and DeepSpeed
ZeRO-Offload (the same stage, `offload_optimizer: cpu`, DeepSpeedCPUAdam) on the same GPT
(the 7b preset's width with `--layers` blocks: 34 give 7.07B parameters), bf16 compute,
AdamW, the same random tokens. Per row: step time (median after warmup), tokens/s, peak
GPU memory, peak host RSS and init time. CPU optimizer rows: parameters/s of one AdamW
step over `--adam-params` fp32 parameters in tensors of `--chunk` elements, with every
core: torch's fused and foreach AdamW (what zeroshard's offloaded step runs) and
DeepSpeedCPUAdam. Every part runs in a process of its own under a time limit, so an
out-of-memory (host or GPU), a failed JIT build or a timeout becomes a row saying so.
A full run writes the "offload" section of docs/benchmarks.md; --smoke writes bench-out/.
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
from benchmarks.offload._report import report

WORKER = "benchmarks.offload._worker"  # run with -m from the repository root


def parse_args() -> argparse.Namespace:
    """Command-line options."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true", help="tiny model on the CPU")
    p.add_argument(
        "--parts", default="adam-torch-fused,adam-torch-foreach,train-zs,adam-ds,train-ds"
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
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--adam-params", type=int, default=10**9)
    p.add_argument("--chunk", type=int, default=32 * 2**20, help="elements per CPU tensor")
    p.add_argument("--adam-steps", type=int, default=3)
    p.add_argument("--section", default="offload", help="docs/benchmarks.md section to write")
    p.add_argument("--budget-s", type=float, default=450.0, help="wall time for all parts")
    args = p.parse_args()
    if args.smoke:
        args.preset, args.layers, args.seq_len, args.micro_batch = "tiny", 2, 64, 2
        args.adam_params, args.chunk, args.adam_steps, args.steps = 2 * 10**6, 2**19, 2, 2
    return args


# Seconds each part may take at most (the run's budget shrinks them when it runs short).
LIMITS = {
    "adam-torch-fused": 40.0,
    "adam-torch-foreach": 30.0,
    "train-zs": 150.0,
    # DeepSpeedCPUAdam is built on first use (ninja); the train part reuses the build.
    "adam-ds": 100.0,
    "train-ds": 130.0,
}


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
            "smoke",
        )
    }
    placement = place_ranks(1, smoke=args.smoke)  # what each part's process joins as
    print(f"[offload] ranks: {placement.describe()}", flush=True)
    deadline = time.perf_counter() + args.budget_s
    results: dict[str, dict[str, Any]] = {}
    for part in args.parts.split(","):
        if part not in LIMITS:
            raise SystemExit(f"unknown part {part!r}; valid: {', '.join(LIMITS)}")
        left = deadline - time.perf_counter()
        if left < 10:
            results[part] = {"ok": False, "error": "skipped: time budget spent", "wall_s": 0.0}
            continue
        # Smoke runs on a shared CPU: DeepSpeed's JIT build may not finish there at all.
        limit = min(LIMITS[part], left, 60.0 if args.smoke else LIMITS[part])
        results[part] = run_part(part, shared, limit)
        print(f"{part}: {json.dumps(results[part])[:300]}", flush=True)
    body = report(args, results)
    print(body)
    title = "CPU offload (one GPU)" + (f" ({args.section})" if args.section != "offload" else "")
    publish(args.section, title, body, smoke=args.smoke, ranks=placement.describe())


if __name__ == "__main__":
    main()
