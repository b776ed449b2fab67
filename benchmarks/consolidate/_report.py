"""The markdown of benchmarks/consolidate: the checkpoint, the disk floor, the table (cold
and warm), how the runs were made, the goals."""

from __future__ import annotations

import argparse
import math
import os
import statistics

from benchmarks._common import markdown_table
from benchmarks.consolidate._floor import Floor
from benchmarks.consolidate._measure import GIB, MODES, ZEROSHARD, Measurements
from benchmarks.consolidate._source import Checkpoint, Source


def _stats(values: list[float]) -> tuple[float, float, float]:
    """Median, min and max."""
    return statistics.median(values), min(values), max(values)


def report(
    source: Source,
    args: argparse.Namespace,
    ckpt: Checkpoint,
    made: float,
    floor: Floor,
    m: Measurements,
) -> str:
    """The markdown section (`made`: seconds the checkpoint took, NaN if reused)."""
    peer = source.peer
    labels = {peer: m.peer_label, ZEROSHARD: "zeroshard-ckpt consolidate"}
    median = {key: _stats([r.seconds for r in rs])[0] for key, rs in m.runs.items()}
    rows = []
    for mode in MODES:
        for tool in (peer, ZEROSHARD):
            rs = m.runs[(tool, mode)]
            mid, lo, hi = _stats([r.seconds for r in rs])
            rows.append(
                [
                    mode,
                    labels[tool],
                    f"{mid:.2f}",
                    f"{lo:.2f}-{hi:.2f}",
                    f"{statistics.median(r.sync_seconds for r in rs):.2f}",
                    f"{rs[0].out_bytes / mid / 1e9:.2f}",
                    f"{max(r.peak_rss for r in rs) / GIB:.2f}",
                    f"{statistics.median(r.read_bytes for r in rs) / 1e9:.2f}",
                    f"{median[(peer, mode)] / mid:.2f}x",
                    f"{mid / floor.of(mode):.2f}x",
                ]
            )
    shard_gb = ", ".join(f"{p.stat().st_size / 1e9:.2f}" for p in ckpt.shard_files)
    took = "" if math.isnan(made) else f" in {made:.0f} s"
    out_gb = m.runs[(ZEROSHARD, "cold")][0].out_bytes / 1e9
    lines = [
        f"{source.kind} of a GPT (d {args.d_model}, {args.layers} layers, vocab "
        f"{args.vocab}, head {'untied' if args.untied else 'tied to the embedding'}): "
        f"{ckpt.params / 1e9:.3f} B parameters, made by {source.made_by} on {ckpt.world} "
        f"ranks{took} ({source.shard_files} of {shard_gb} GB). {os.cpu_count()} cores; "
        f"zeroshard workers: {args.workers or 'all'}.",
        "",
        f"Disk floor (dd, 4 MiB blocks, this run): writing the {out_gb:.2f} GB output with "
        f"fdatasync {floor.write:.2f} s; reading the {ckpt.read_bytes / 1e9:.2f} GB that must "
        f"be read {floor.cold_read:.2f} s cold, {floor.warm_read:.2f} s from the page cache. "
        f"Floor: cold {floor.cold:.2f} s, warm {floor.warm:.2f} s.",
        "",
        markdown_table(
            [
                "input",
                "tool",
                f"median s ({args.repeats} runs)",
                "spread s",
                "of which fsync s",
                "GB/s",
                "peak RSS GiB",
                "read from disk GB",
                f"speed-up vs {peer}",
                "x floor",
            ],
            rows,
        ),
        "",
        "Cold: every input and output file fsynced and evicted from the page cache before "
        "each run; warm: the input read just before. The tools' order alternates by round.",
    ]
    if m.peer_failure:
        lines.append(f"{m.peer_failure}; timed {m.peer_label}.")
    lines.append(
        f"Times include fsync of the output: zeroshard syncs before it exits, {peer} does "
        "not, so the benchmark syncs its files after it exits (that part is shown)."
    )
    lines.append(
        f"Outputs compared tensor by tensor: {m.checked} tensors bit-identical (tied names "
        "included)."
    )
    if source.has_goals:
        lines.append(_goals(peer, m, median, floor))
    return "\n".join(lines)


def _goals(peer: str, m: Measurements, median: dict[tuple[str, str], float], floor: Floor) -> str:
    ours = m.runs[(ZEROSHARD, "cold")] + m.runs[(ZEROSHARD, "warm")]
    peak = max(r.peak_rss for r in ours) / GIB
    goals = [
        f"{mode}: {median[(peer, mode)] / median[(ZEROSHARD, mode)]:.2f}x {peer} (goal >= 3x), "
        f"{median[(ZEROSHARD, mode)] / floor.of(mode):.2f}x the floor (goal <= 1.4x)"
        for mode in MODES
    ]
    return f"Goals: {'; '.join(goals)}; peak RSS {peak:.2f} GiB (goal <= 2 GiB)."
