"""Summarize a torch.profiler trace: compute, communication, exposed communication, idle.

Works on the Chrome trace JSON that `profile.export_chrome_trace` writes, so it depends on
nothing but the trace format: device kernels are events with `"cat": "kernel"`, a start
`ts` and a duration `dur` in microseconds; NCCL's kernels are named `nccl...`.

- compute: time covered by at least one non-NCCL kernel;
- communication: time covered by at least one NCCL kernel;
- exposed communication: NCCL time during which no compute kernel runs (what overlap
  failed to hide);
- idle: time in the window (first kernel start to last kernel end) with no kernel at all,
  which is where the GPU waits on the host (launch overhead, Python, synchronization);
- optimizer: time covered by the kernels launched inside the optimizer step (a CPU range
  named `Optimizer.step...`, torch's own label, or `zeroshard::optimizer_step`), found through
  the correlation id that ties each kernel to its launch;
- overlap slowdown: of the compute kernels that ran while an NCCL kernel ran, the time
  each took beyond the median of the same kernel (by name) in a reference trace without
  communication (the `floor` engine's), or else beyond the median of its own instances
  that ran alone. This is the cost (b) of issue 13: kernels slowed by the collectives
  that overlap them (SMs and memory bandwidth taken by NCCL), as opposed to (a), the
  exposed communication.

The split of a step for the plot is compute (without the optimizer), optimizer, exposed
communication and idle: disjoint, summing to the window.
"""

from __future__ import annotations

import bisect
import json
import statistics
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

Interval = tuple[float, float]


def union(intervals: list[Interval]) -> list[Interval]:
    """Sorted, disjoint intervals covering exactly the same points as `intervals`."""
    merged: list[Interval] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def length(intervals: list[Interval]) -> float:
    """Total length of disjoint intervals."""
    return sum(end - start for start, end in intervals)


def subtract(a: list[Interval], b: list[Interval]) -> list[Interval]:
    """Parts of disjoint sorted `a` not covered by disjoint sorted `b`."""
    out: list[Interval] = []
    j = 0
    for start, end in a:
        cur = start
        while j < len(b) and b[j][1] <= cur:
            j += 1
        k = j
        while k < len(b) and b[k][0] < end:
            if b[k][0] > cur:
                out.append((cur, b[k][0]))
            cur = max(cur, b[k][1])
            k += 1
        if cur < end:
            out.append((cur, end))
    return out


def covered(start: float, end: float, b: list[Interval], ends: list[float]) -> float:
    """Length of [start, end) covered by disjoint sorted `b` (`ends`: b's ends, for bisect);
    logarithmic in len(b), so a trace of many thousand kernels is summarized in seconds."""
    total = 0.0
    i = bisect.bisect_right(ends, start)  # the first interval ending after `start`
    while i < len(b) and b[i][0] < end:
        total += min(end, b[i][1]) - max(start, b[i][0])
        i += 1
    return total


OPTIMIZER_LABELS = ("Optimizer.step", "zeroshard::optimizer_step")


@dataclass(frozen=True)
class Kernel:
    """One device kernel of a trace: name, start and duration (us), launch correlation id."""

    name: str
    start: float
    dur: float
    correlation: int | None = None

    @property
    def is_comm(self) -> bool:
        """An NCCL kernel (a collective)."""
        return self.name.lower().startswith("nccl")


@dataclass(frozen=True)
class TraceSummary:
    """Per-step milliseconds of one profiled engine (see the module docstring)."""

    steps: int
    window_ms: float
    compute_ms: float
    comm_ms: float
    exposed_comm_ms: float
    idle_ms: float
    optimizer_ms: float = 0.0
    overlapped_compute_ms: float = 0.0  # compute kernel time during which NCCL also ran
    overlap_slowdown_ms: float = 0.0

    @property
    def compute_only_ms(self) -> float:
        """Compute kernel time outside the optimizer step."""
        return self.compute_ms - self.optimizer_ms


def kernel_medians(kernels: Iterable[Kernel]) -> dict[str, float]:
    """Median duration (us) of each compute kernel, by name."""
    by_name: dict[str, list[float]] = {}
    for k in kernels:
        if not k.is_comm:
            by_name.setdefault(k.name, []).append(k.dur)
    return {name: statistics.median(durs) for name, durs in by_name.items()}


def _slowdown(
    compute: list[Kernel], comm: list[Interval], reference: dict[str, float] | None
) -> tuple[float, float]:
    """(overlapped compute us, extra us) of the compute kernels that overlap NCCL ones."""
    overlapped: list[Kernel] = []
    alone: list[Kernel] = []
    total = 0.0
    ends = [end for _, end in comm]
    for k in compute:
        share = covered(k.start, k.start + k.dur, comm, ends)
        total += share
        (overlapped if share > 0 else alone).append(k)
    own = kernel_medians(alone)
    extra = 0.0
    for k in overlapped:
        base = (reference or {}).get(k.name, own.get(k.name))
        if base is not None:
            extra += max(0.0, k.dur - base)
    return total, extra


def summarize(
    kernels: list[Kernel],
    steps: int,
    optimizer: set[int] | None = None,
    reference: dict[str, float] | None = None,
) -> TraceSummary | None:
    """Summary of `kernels` over `steps` steps; None if there are none.

    `optimizer`: correlation ids of the kernels the optimizer step launched;
    `reference`: per-name median kernel durations without communication (`kernel_medians`
    of the floor's trace).
    """
    if not kernels:
        return None
    comm_k = [k for k in kernels if k.is_comm]
    compute_k = [k for k in kernels if not k.is_comm]
    comm = union([(k.start, k.start + k.dur) for k in comm_k])
    compute = union([(k.start, k.start + k.dur) for k in compute_k])
    opt_ids = optimizer or set()
    opt = union([(k.start, k.start + k.dur) for k in compute_k if k.correlation in opt_ids])
    busy = union(comm + compute)
    window = busy[-1][1] - busy[0][0]
    overlapped, extra = _slowdown(compute_k, comm, reference)
    per_step_ms = 1.0 / (1000.0 * steps)
    return TraceSummary(
        steps=steps,
        window_ms=window * per_step_ms,
        compute_ms=length(compute) * per_step_ms,
        comm_ms=length(comm) * per_step_ms,
        exposed_comm_ms=length(subtract(comm, compute)) * per_step_ms,
        idle_ms=(window - length(busy)) * per_step_ms,
        optimizer_ms=length(opt) * per_step_ms,
        overlapped_compute_ms=overlapped * per_step_ms,
        overlap_slowdown_ms=extra * per_step_ms,
    )


def read_trace(path: Path) -> tuple[list[Kernel], set[int]]:
    """The device kernels of a Chrome trace file, and the correlation ids of those that
    were launched inside the optimizer step (see OPTIMIZER_LABELS)."""
    events = json.loads(path.read_text()).get("traceEvents", [])
    kernels: list[Kernel] = []
    launches: list[tuple[object, float, int]] = []  # (thread, ts, correlation)
    ranges: dict[object, list[Interval]] = {}
    for e in events:
        if "ts" not in e or "dur" not in e:
            continue
        cat, name = e.get("cat"), str(e.get("name", ""))
        ts, dur = float(e["ts"]), float(e["dur"])
        corr = (e.get("args") or {}).get("correlation")
        if cat == "kernel":
            kernels.append(Kernel(name, ts, dur, corr if isinstance(corr, int) else None))
        elif cat in ("cuda_runtime", "cuda_driver") and isinstance(corr, int):
            launches.append(((e.get("pid"), e.get("tid")), ts, corr))
        elif cat in ("cpu_op", "user_annotation") and name.startswith(OPTIMIZER_LABELS):
            ranges.setdefault((e.get("pid"), e.get("tid")), []).append((ts, ts + dur))
    merged = {thread: union(r) for thread, r in ranges.items()}
    optimizer = {
        corr
        for thread, ts, corr in launches
        if any(start <= ts <= end for start, end in merged.get(thread, ()))
    }
    return kernels, optimizer


def summarize_chrome_trace(
    path: Path, steps: int, reference: dict[str, float] | None = None
) -> TraceSummary | None:
    """`summarize` over the device kernels of a Chrome trace file."""
    kernels, optimizer = read_trace(path)
    return summarize(kernels, steps, optimizer, reference)
