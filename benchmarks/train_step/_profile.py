"""Profile two training steps of one engine and summarize its trace (rank 0).

The floors' traces (`floor`, `floorc`) are kept as per-kernel references, so the
engines profiled after them get the overlap slowdown measured against kernels that ran
with no communication at all (see `_trace.py`).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

from benchmarks.train_step._engines import ENGINES
from benchmarks.train_step._trace import TraceSummary, kernel_medians, read_trace, summarize

# Per-name median kernel durations of the floors' traces (rank 0), the reference against
# which `summarize` measures how much overlapping collectives slow each compute kernel:
# `floor` for the eager engines, `floorc` for the compiled ones (inductor's own kernels).
REFERENCE: dict[str, dict[str, float]] = {}


def profile(
    name: str,
    step: Callable[[torch.Tensor, torch.Tensor], None],
    data: tuple[torch.Tensor, torch.Tensor],
    device: torch.device,
    prefix: Path,
) -> TraceSummary | None:
    """Profile two steps of engine `name`; on rank 0 write the Chrome trace to
    `<prefix>_<name>.trace.json` and summarize it (None on the other ranks)."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    activities = [ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    with torch_profile(activities=activities) as prof:
        for _ in range(2):
            step(*data)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    if dist.get_rank() != 0:
        return None  # rank 0's trace is the one summarized; the others need no files
    prefix.parent.mkdir(parents=True, exist_ok=True)
    path = prefix.with_name(f"{prefix.name}_{name}.trace.json")
    prof.export_chrome_trace(str(path))
    kernels, optimizer = read_trace(path)
    engine = ENGINES[name]
    if engine.rank0_only:
        REFERENCE[name] = kernel_medians(kernels)
    return summarize(kernels, 2, optimizer, REFERENCE.get(engine.floor))
