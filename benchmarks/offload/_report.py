"""The markdown of benchmarks/offload: training rows, CPU AdamW rows, ratios, part times."""

from __future__ import annotations

import argparse
from typing import Any

from benchmarks._common import markdown_table


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
        f"{args.warmup} warmup. One process per row.\n\n"
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
