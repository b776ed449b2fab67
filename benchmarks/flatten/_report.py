"""The markdown of benchmarks/flatten: what was measured, one row per method."""

from __future__ import annotations

import argparse
import math

import torch

from benchmarks._common import markdown_table
from zeroshard.partition import FlatLayout

GIB = 1024**3


def _num(x: float) -> str:
    return "n/a" if math.isnan(x) else f"{x:.2f}"


def report(
    results: dict[str, dict[str, float]],
    layout: FlatLayout,
    device: torch.device,
    ranks: str,
    args: argparse.Namespace,
) -> str:
    """The markdown body: what was measured and one row per method."""
    model_bytes = layout.numel * layout.dtype.itemsize
    base = results["torch.cat"]
    on_gpu = device.type == "cuda"
    header = ["method", "time (ms)", "time vs torch.cat", "peak (GiB)", "peak / params"]
    if on_gpu:
        header += ["peak vs torch.cat", "host peak (GiB)"]
    else:
        header += ["peak vs torch.cat"]
    rows: list[list[object]] = []
    for name, r in results.items():
        row: list[object] = [
            name,
            f"{r['time_s'] * 1e3:,.1f}",
            f"{r['time_s'] / base['time_s']:.2f}",
            _num(r["device_peak"] / GIB),
            _num(r["device_peak"] / model_bytes),
            _num(r["device_peak"] / base["device_peak"]),
        ]
        if on_gpu:
            row.append(_num(r["host_peak"] / GIB))
        rows.append(row)
    where = "GPU memory (torch.cuda.max_memory_allocated)" if on_gpu else "peak RSS"
    intro = (
        f"GPT-2-style layout (d {args.d_model}, {args.layers} layers, vocab {args.vocab}, "
        f"seq {args.seq_len}): "
        f"{len(layout.slots)} parameters, {layout.numel / 1e9:.3f} B elements of "
        f"{layout.dtype} ({model_bytes / GIB:.2f} GiB), alignment {layout.alignment}, "
        f"{ranks}. Median of "
        f"{args.repeats} runs, slowest rank. Peak: {where} above the level "
        "before the parameters were built, so the parameters themselves count once; "
        "`peak / params` is that peak over their size (2.0 = originals + one full copy). "
        "All methods packed the same bytes (checked)."
    )
    if not on_gpu:
        intro += (
            " The ranks' device is the host here, so DEVICE and CPU make the same copy."
            " On gloo, all_gather_into_tensor itself stages the output through a temporary "
            "of the output's size (we measured it), which adds 1.0 to the "
            "DISTRIBUTED peak here; NCCL gathers in place."
        )
    table: str = markdown_table(header, rows)
    return intro + "\n\n" + table
