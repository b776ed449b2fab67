"""Time one flattening method over fresh parameters, with its memory peaks, on every rank."""

from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from benchmarks.flatten._memory import Meter
from zeroshard.comm import Group
from zeroshard.partition import FlatLayout


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _make_params(layout: FlatLayout, device: torch.device) -> list[torch.Tensor]:
    # The same seed on every rank: replicated parameters, as the DISTRIBUTED tier requires.
    gen = torch.Generator(device=device).manual_seed(0)
    return [
        torch.randn(s.shape, dtype=layout.dtype, device=device, generator=gen) for s in layout.slots
    ]


def torch_cat(params: list[torch.Tensor], layout: FlatLayout) -> torch.Tensor:
    """The naive flatten: one torch.cat, then every param re-pointed at its view."""
    with torch.no_grad():
        flat = torch.cat([p.reshape(-1) for p in params])
    off = 0
    for p in params:
        p.data = flat[off : off + p.numel()].view(p.shape)
        off += p.numel()
    return flat


def _fingerprint(flat: torch.Tensor) -> int:
    """Sum of the buffer's bytes: equal for every method that packed the same values
    (zero padding adds nothing)."""
    return int(flat.view(torch.uint8).sum(dtype=torch.int64).item())


def measure(
    name: str,
    run: Callable[[list[torch.Tensor]], torch.Tensor],
    layout: FlatLayout,
    device: torch.device,
    repeats: int,
) -> dict[str, float]:
    """Median time and peaks of `run` over fresh parameters, max over ranks."""
    meter = Meter(device)
    times, dev_peaks, host_peaks, prints = [], [], [], set()
    for _ in range(repeats):
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        dev_base, host_base = meter.device_now(), meter.host_now()
        params = _make_params(layout, device)
        _sync(device)
        dist.barrier()  # every rank starts together: the DISTRIBUTED tier waits on peers
        meter.reset()
        t0 = time.perf_counter()
        flat = run(params)
        _sync(device)
        times.append(time.perf_counter() - t0)
        dev_peaks.append(meter.device_peak() - dev_base)
        host_peaks.append(meter.host_peak() - host_base)
        prints.add(_fingerprint(flat))
        del flat, params
    if len(prints) != 1:
        raise RuntimeError(f"{name}: repeats packed different bytes")
    figures = [statistics.median(times), max(dev_peaks), max(host_peaks), prints.pop()]
    t = torch.tensor(figures, dtype=torch.float64, device=Group().device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return dict(zip(("time_s", "device_peak", "host_peak", "fingerprint"), t.tolist(), strict=True))
