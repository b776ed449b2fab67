"""Host and device time of one fetch + release, the slowest rank's medians."""

from __future__ import annotations

import functools
import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class Timing:
    """Slowest rank's medians in ms: host until return, device (synced, queued); nan on CPU."""

    host: float
    device: float
    queued: float


def _event() -> torch.cuda.Event:
    return torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]


def _sleep(cycles: int) -> None:
    torch.cuda._sleep(cycles)  # type: ignore[no-untyped-call]


@functools.cache
def _sleep_cycles_per_ms() -> float:
    start, end = _event(), _event()
    start.record()
    _sleep(10_000_000)
    end.record()
    torch.cuda.synchronize()
    return 10_000_000 / float(start.elapsed_time(end))


def measure(fn: Callable[[], None], iters: int, warmup: int, cuda: bool) -> Timing:
    """Median host and device time of `fn` (see the module doc), slowest rank."""
    for _ in range(warmup):
        fn()
    if cuda:
        torch.cuda.synchronize()
    dist.barrier()
    host: list[float] = []
    device: list[float] = []
    for _ in range(iters):
        if cuda:
            start, end = _event(), _event()
            start.record()
        t0 = time.perf_counter()
        fn()
        host.append((time.perf_counter() - t0) * 1e3)
        if cuda:
            end.record()
            torch.cuda.synchronize()
            device.append(start.elapsed_time(end))
    queued = math.nan
    if cuda:
        dist.barrier()
        starts = [_event() for _ in range(iters)]
        ends = [_event() for _ in range(iters)]
        # The sleep covers queueing every iteration (2x margin, + 1 ms), so the events
        # time the device's work back to back, not gaps waiting for the host.
        ms = 2 * iters * statistics.median(host) + 1
        _sleep(int(_sleep_cycles_per_ms() * ms))
        for s, e in zip(starts, ends, strict=True):
            s.record()
            fn()
            e.record()
        torch.cuda.synchronize()
        queued = statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends, strict=True))
    stats = torch.tensor(
        [statistics.median(host), statistics.median(device) if cuda else math.nan, queued],
        dtype=torch.float64,
        device="cuda" if cuda else "cpu",
    )
    dist.all_reduce(stats, op=dist.ReduceOp.MAX)
    return Timing(float(stats[0]), float(stats[1]), float(stats[2]))
