"""Summarize a torch.profiler trace: compute, communication, exposed communication, idle.

Works on the Chrome trace JSON that `profile.export_chrome_trace` writes, so it depends on
nothing but the trace format: device kernels are events with `"cat": "kernel"`, a start
`ts` and a duration `dur` in microseconds; NCCL's kernels are named `nccl...`.

- compute: time covered by at least one non-NCCL kernel;
- communication: time covered by at least one NCCL kernel;
- exposed communication: NCCL time during which no compute kernel runs (what overlap
  failed to hide);
- idle: time in the window (first kernel start to last kernel end) with no kernel at all,
  which is where the GPU waits on the host (launch overhead, Python, synchronization).
"""

from __future__ import annotations

import json
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


@dataclass(frozen=True)
class TraceSummary:
    """Per-step milliseconds of one profiled engine (see the module docstring)."""

    steps: int
    window_ms: float
    compute_ms: float
    comm_ms: float
    exposed_comm_ms: float
    idle_ms: float


def summarize(kernels: list[tuple[str, float, float]], steps: int) -> TraceSummary | None:
    """Summary of (name, start_us, duration_us) kernels over `steps` steps; None if none."""
    if not kernels:
        return None
    comm = union([(t, t + d) for name, t, d in kernels if name.lower().startswith("nccl")])
    compute = union([(t, t + d) for name, t, d in kernels if not name.lower().startswith("nccl")])
    busy = union(comm + compute)
    window = busy[-1][1] - busy[0][0]
    per_step_ms = 1.0 / (1000.0 * steps)
    return TraceSummary(
        steps=steps,
        window_ms=window * per_step_ms,
        compute_ms=length(compute) * per_step_ms,
        comm_ms=length(comm) * per_step_ms,
        exposed_comm_ms=length(subtract(comm, compute)) * per_step_ms,
        idle_ms=(window - length(busy)) * per_step_ms,
    )


def summarize_chrome_trace(path: Path, steps: int) -> TraceSummary | None:
    """`summarize` over the device kernels of a Chrome trace file."""
    events = json.loads(path.read_text()).get("traceEvents", [])
    kernels = [
        (str(e.get("name", "")), float(e["ts"]), float(e["dur"]))
        for e in events
        if e.get("cat") == "kernel" and "ts" in e and "dur" in e
    ]
    return summarize(kernels, steps)
