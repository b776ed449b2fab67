"""Time one engine on every rank: build, wrap, warm up, step, profile; agree on the figures."""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time
import traceback
from typing import NamedTuple

import torch
import torch.distributed as dist

from benchmarks._common import SMOKE_OUT, free, sync
from benchmarks._common._models import BenchModel
from benchmarks.train_step._engines import ENGINES
from benchmarks.train_step._profile import profile
from benchmarks.train_step._result import Result
from benchmarks.train_step._settings import Settings, Skipped
from benchmarks.train_step._trace import TraceSummary

GIB = 1024**3


def _agree(values: list[float], ok: bool, error: str | None) -> tuple[list[float], str | None]:
    """Max of `values` over ranks (the slowest rank), and the first rank's error if any."""
    t = torch.tensor([*values, 0.0 if ok else 1.0], dtype=torch.float64)
    if dist.get_backend() == "nccl":
        t = t.cuda()
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    errors: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(errors, error)
    first = next((e for e in errors if e), None)
    failed = t[-1].item() > 0
    return t[:-1].tolist(), (first or "failed on another rank") if failed else None


class Measured(NamedTuple):
    """One engine's figures on this rank."""

    build_s: float  # constructing the model on the device, before any engine sees it
    init_s: float
    times: list[float]
    peak_gib: float  # max allocated from wrapping to the last step
    states_gib: float  # allocated after the last step above the level before the build
    trace: TraceSummary | None


def _measure(
    name: str,
    bm: BenchModel,
    settings: Settings,
    args: argparse.Namespace,
    data: tuple[torch.Tensor, torch.Tensor],
    profiled: bool,
) -> Measured:
    """Build, wrap, warm up, time (and, if `profiled`, profile) one engine on this rank.

    Everything the engine allocates is local to this frame, so it is all released when
    the function returns or raises (see `free`).
    """
    device = settings.device
    if ENGINES[name].compiled:
        # Every compiled engine traces afresh, in every round: none reuses the graphs of
        # another (or its own of an earlier round), and none runs into Dynamo's
        # recompile limit, past which it would fall back to eager without an error.
        torch._dynamo.reset()
    # A first, untimed set-up on a tiny model pays what any engine pays only once per
    # process (imports, DeepSpeed's accelerator and communication set-up, kernel caches),
    # so `init_s` is the cost of wrapping THIS model whichever engine runs first.
    with torch.device(device):
        throwaway = bm.tiny()
    ENGINES[name].setup(throwaway, settings)
    del throwaway
    free(device)
    cuda = device.type == "cuda"
    before = torch.cuda.memory_allocated(device) if cuda else 0
    torch.manual_seed(0)
    # Built straight on the device, once, the same way for every engine: initializing on
    # the GPU takes seconds even at 7B (build_s says how many), and a fresh fp32 model is
    # what every engine's wrapping starts from.
    t0 = time.perf_counter()
    with torch.device(device):
        model = bm.build()
    sync(device)
    build_s = time.perf_counter() - t0
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    t0 = time.perf_counter()
    step = ENGINES[name].setup(model, settings)
    sync(device)
    init_s = time.perf_counter() - t0
    del model  # the engine holds what it needs
    times = []
    for i in range(args.warmup + args.steps):
        t0 = time.perf_counter()
        step(*data)
        sync(device)
        if i >= args.warmup:
            times.append(time.perf_counter() - t0)
    # Between steps an engine keeps its model states (parameters, optimizer state, any
    # persistent gradient shards): what the 16 psi / N bound is about.
    states = (torch.cuda.memory_allocated(device) - before) / GIB if cuda else 0.0
    trace = profile(name, step, data, device, SMOKE_OUT / args.section) if profiled else None
    peak = torch.cuda.max_memory_allocated(device) / GIB if cuda else 0.0
    return Measured(build_s, init_s, times, peak, states, trace)


def run_engine(
    name: str,
    bm: BenchModel,
    settings: Settings,
    args: argparse.Namespace,
    data: tuple[torch.Tensor, torch.Tensor],
    profiled: bool,
) -> Result:
    """Build, wrap, warm up and time (and, if `profiled`, profile) one engine; every rank
    calls this."""
    engine = ENGINES[name]
    world = dist.get_world_size()
    shard = settings.shard_group_size
    what = engine.what.format(shard=shard, replicate=max(world // shard, 1), tp=settings.tp)
    rank = dist.get_rank()
    m = Measured(0.0, 0.0, [], 0.0, 0.0, None)
    error: str | None = None
    skipped: str | None = None
    dist.barrier()
    if rank == 0 or not engine.rank0_only:
        try:
            m = _measure(name, bm, settings, args, data, profiled)
        except Skipped as e:  # the same on every rank: the world decides it
            skipped = str(e)
        except Exception as e:  # OOM, import error, engine bug: a row, not the end
            error = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:160]
            if rank == 0:
                traceback.print_exc()
    free(settings.device)  # after the except block, so the traceback's frames are gone
    if engine.rank0_only:
        dist.barrier()  # the others waited here while rank 0 ran alone
    if skipped:  # the hybrid's sizes do not apply: name the engine only
        return Result(name, engine.what.split(":")[0], skipped=skipped)
    median = statistics.median(m.times) if m.times else 0.0
    cuda = settings.device.type == "cuda"
    left = torch.cuda.memory_allocated(settings.device) / GIB if cuda else 0.0
    figures = [m.build_s, m.init_s, median, m.peak_gib, m.states_gib, left]
    values, error = _agree(figures, error is None, error)
    build_s, init_s, median, peak, states, left = values
    if error:
        return Result(name, what, error=error, left_gib=left)
    return Result(
        name,
        what,
        init_s,
        median * 1000,
        peak or None,
        None,
        m.trace,
        left,
        build_s=build_s,
        states_gib=states or None,
        tp=settings.tp if engine.tensor_parallel else 1,
    )


def combine(rounds: list[Result]) -> Result:
    """One engine's row from its rounds: the median of the rounds' median steps (and of
    their init and build times), the largest peak, states and leftover, the last trace;
    a round that failed or was skipped is the row."""
    failed = next((r for r in rounds if r.step_ms is None), None)
    if failed is not None:
        return failed
    steps = tuple(r.step_ms for r in rounds if r.step_ms is not None)

    def most(values: list[float | None]) -> float | None:
        present = [v for v in values if v is not None]
        return max(present) if present else None

    return dataclasses.replace(
        rounds[-1],
        init_s=statistics.median(r.init_s or 0.0 for r in rounds),
        step_ms=statistics.median(steps),
        build_s=statistics.median(r.build_s or 0.0 for r in rounds),
        peak_gib=most([r.peak_gib for r in rounds]),
        states_gib=most([r.states_gib for r in rounds]),
        left_gib=max(r.left_gib for r in rounds),
        trace=next((r.trace for r in reversed(rounds) if r.trace is not None), None),
        rounds_ms=steps,
    )


def warm_up_process(device: torch.device) -> None:
    """Pay the one-time costs (optimizer and dynamo imports, CUDA/NCCL and kernel set-up)
    before any engine, so that the first engine's init time is not charged for them."""
    p = torch.nn.Parameter(torch.ones(64, 64, device=device))
    opt = torch.optim.AdamW([p], fused=device.type == "cuda")
    with torch.autocast(device.type, dtype=torch.bfloat16):
        loss: torch.Tensor = torch.mm(p, p).float().sum()
    torch.autograd.backward(loss)
    opt.step()
    t = torch.ones(1024, device=device)
    dist.all_reduce(t)
    dist.barrier()
    sync(device)
