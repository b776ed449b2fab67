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

from benchmarks._report import markdown_table, publish

WORKER = "benchmarks._offload_workers"  # run with -m from the repository root


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


def _cell(r: dict[str, Any], key: str, fmt: str) -> str:
    return format(r[key], fmt) if r.get("ok") else "-"


def report(args: argparse.Namespace, results: dict[str, dict[str, Any]]) -> str:
    """The markdown body: training rows, CPU AdamW rows, ratios and part times."""
    train = [p for p in results if p.startswith("train-")]
    names = {"train-zs": "zeroshard offload_optimizer", "train-ds": "DeepSpeed ZeRO-Offload"}
    rows = []
    for p in train:
        r = results[p]
        params = f"{r['params'] / 1e9:.2f}B" if r.get("ok") else "-"
        rows.append(
            [
                f"{names[p]} (stage {args.stage})",
                params,
                _cell(r, "step_s", ".2f"),
                _cell(r, "tokens_per_s", ",.0f"),
                _cell(r, "gpu_peak_gib", ".1f"),
                _cell(r, "host_peak_gib", ".1f"),
                _cell(r, "init_s", ".0f"),
                "ok" if r.get("ok") else r["error"],
            ]
        )
    recompute = "on" if args.activation_checkpointing else "off"
    body = (
        f"GPT `{args.preset}` width, {args.layers} blocks, seq {args.seq_len}, micro-batch "
        f"{args.micro_batch}, activation checkpointing {recompute}, "
        f"bf16 compute, AdamW; median of {args.steps} steps after "
        f"{args.warmup} warmup. One GPU, one process per row.\n\n"
    )
    body += markdown_table(
        ["engine", "params", "step s", "tokens/s", "GPU peak GiB", "host peak GiB", "init s", ""],
        rows,
    )
    zs, ds = results.get("train-zs", {}), results.get("train-ds", {})
    if zs.get("ok") and ds.get("ok"):
        body += f"\n\nzeroshard / DeepSpeed tokens/s: {zs['tokens_per_s'] / ds['tokens_per_s']:.2f}"
    adam_names = {
        "adam-torch-fused": "torch AdamW fused=True (CPU)",
        "adam-torch-foreach": "torch AdamW foreach=True (CPU)",
        "adam-ds": "DeepSpeedCPUAdam",
    }
    adam_rows = []
    for p, label in adam_names.items():
        if p in results:
            r = results[p]
            rate = f"{r['params_per_s'] / 1e6:,.0f}M" if r.get("ok") else "-"
            threads = r.get("threads", "-") if r.get("ok") else "-"
            n = f"{r['params'] / 1e9:g}B" if r.get("ok") else "-"
            adam_rows.append(
                [
                    label,
                    n,
                    rate,
                    _cell(r, "step_s", ".3f"),
                    threads,
                    "ok" if r.get("ok") else r["error"],
                ]
            )
    body += (
        f"\n\nCPU optimizer step over fp32 parameters in tensors of {args.chunk:,} elements "
        f"(foreach on a tenth as many, to bound its time), median of {args.adam_steps} "
        "steps:\n\n"
    )
    body += markdown_table(["optimizer", "params", "params/s", "step s", "threads", ""], adam_rows)
    fused, dsa = results.get("adam-torch-fused", {}), results.get("adam-ds", {})
    if fused.get("ok") and dsa.get("ok"):
        ratio = fused["params_per_s"] / dsa["params_per_s"]
        body += f"\n\ntorch fused / DeepSpeedCPUAdam params/s: {ratio:.2f}"
    times = ", ".join(f"{p} {r['wall_s']:.0f}s" for p, r in results.items())
    body += f"\n\nWall time per part: {times}."
    return body


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
        )
    }
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
    publish(args.section, title, body, smoke=args.smoke)


if __name__ == "__main__":
    main()
