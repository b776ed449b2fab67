"""The markdown of benchmarks/leaf_fetch: setup, verdict against the goal, one table."""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass

from benchmarks._common import markdown_table
from benchmarks.leaf_fetch._timing import Timing

MIB = 1024**2
GOAL = 0.3


@dataclass(frozen=True)
class Row:
    """One method's result."""

    method: str
    gathers: int
    collectives: int
    nbytes: int
    timing: Timing


def _ms(x: float) -> str:
    return "-" if math.isnan(x) else f"{x:.3f}"


def _ratio(a: float, b: float) -> str:
    return "-" if math.isnan(a) or math.isnan(b) else f"{a / b:.2f}"


def report(rows: list[Row], ranks: str, args: argparse.Namespace, cuda: bool) -> str:
    """The markdown body: setup, verdict against the goal, one table."""
    leaf, expert, peer = rows
    params = args.experts * (8 * args.d * args.d + 5 * args.d)
    host_ratio = leaf.timing.host / peer.timing.host
    met = "meets" if host_ratio <= GOAL else "misses"
    verdict = [
        f"- host time, leaf / per parameter = {host_ratio:.2f} ({met} the <= {GOAL} goal); "
        f"unit per expert / per parameter = {expert.timing.host / peer.timing.host:.2f}."
    ]
    if cuda:
        verdict.append(
            f"- device time (synchronized), leaf / per parameter = "
            f"{_ratio(leaf.timing.device, peer.timing.device)}; with the host queued ahead "
            f"= {_ratio(leaf.timing.queued, peer.timing.queued)}."
        )
    header = ["method", "gathers", "collectives", "MiB gathered", "host ms", "device ms"]
    header += ["device queued ms", "host / per param", "device / per param"]
    table = [
        [
            r.method,
            r.gathers,
            r.collectives,
            f"{r.nbytes / MIB:.1f}",
            _ms(r.timing.host),
            _ms(r.timing.device),
            _ms(r.timing.queued),
            _ratio(r.timing.host, peer.timing.host),
            _ratio(r.timing.device, peer.timing.device),
        ]
        for r in rows
    ]
    intro = (
        f"{ranks}; an MoE layer of {args.experts} experts (d {args.d} -> "
        f"{4 * args.d} -> {args.d}, with bias: {4 * args.experts} parameters, {params / 1e6:.1f} M "
        f"elements), {args.dtype} gathers. One fetch + release of the whole layer, median of "
        f"{args.iters} iterations after {args.warmup} warm-up (slowest rank). `host ms`: "
        "from the call until gather + release return; `device ms`: CUDA events around the "
        "same, the device synchronized at the end of each iteration; `device queued ms`: "
        "the host queued ahead, so only the device's own work counts. The leaf and "
        "per-expert rows go through the engine's units (`unit.gather(); "
        "unit.release()`), which also casts its fp32 master shard to the compute dtype "
        "before each gather; the per-parameter row keeps resident compute-dtype shards, as "
        "per-tensor engines do, so it has no cast. `collectives` counts all-gathers, plus "
        "the engine's per-gather unit check on gloo. See the docstring of "
        "`benchmarks/leaf_fetch/__main__.py`."
    )
    return f"{intro}\n\n" + "\n".join(verdict) + f"\n\n{markdown_table(header, table)}"
