"""Where a benchmark's ranks run, and how they start: torchrun relaunch or spawn, then join.

[Note: rank placement] Ranks go on GPUs, over NCCL, only where the host has a GPU for
every rank; otherwise (fewer GPUs than ranks, none, or `--smoke`) on the CPU over gloo,
with the host's cores split between them. NCCL cannot put two ranks on one GPU, and a
rank beyond the last GPU fails at once (`device_id cuda:1 is out of range` on a one-GPU
host). A CPU rank on a host that has GPUs must keep every library off them: DeepSpeed
chooses its accelerator from `torch.cuda`, so without DS_ACCELERATOR=cpu it would put
rank 1's parameters on cuda:1 all the same. Every benchmark that starts ranks decides
here, and says where they ran in its output and its report (`Placement.describe`).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from benchmarks._common._report import entry_point


@dataclass(frozen=True)
class Placement:
    """Where the `world` ranks of one host run, on a host with `gpus` GPUs and `cores` cores."""

    world: int
    gpus: int
    cores: int
    smoke: bool = False  # smoke runs stay on the CPU wherever they run

    @property
    def on_gpus(self) -> bool:
        """One GPU per rank, NCCL between them."""
        return not self.smoke and self.gpus >= self.world

    @property
    def backend(self) -> str:
        """The process group's backend."""
        return "nccl" if self.on_gpus else "gloo"

    @property
    def threads(self) -> int:
        """Intra-op threads of each CPU rank: the host's cores shared evenly."""
        return max(1, self.cores // self.world)

    def device(self, local_rank: int) -> torch.device:
        """The device of the rank `local_rank` of this host."""
        return torch.device("cuda", local_rank) if self.on_gpus else torch.device("cpu")

    def describe(self) -> str:
        """Where the ranks ran and why, for the output and the report."""
        ranks = f"{self.world} rank{'s' if self.world > 1 else ''}"
        if self.on_gpus:
            return f"{ranks} on GPUs over NCCL, one GPU each"
        if self.smoke:
            why = "--smoke"
        elif self.gpus == 0:
            why = "no GPU"
        else:
            why = f"{self.gpus} GPU{'s' if self.gpus > 1 else ''} for {ranks}"
        threads = f"{self.threads} thread{'s' if self.threads > 1 else ''}"
        threads += " each" if self.world > 1 else ""
        return f"{ranks} on the CPU over gloo, {threads} ({why})"


def place_ranks(world: int, *, smoke: bool = False) -> Placement:
    """Where `world` ranks run on this host (see [Note: rank placement])."""
    # device_count asks NVML, not the CUDA driver: deciding leaves CUDA uninitialized.
    return Placement(world, torch.cuda.device_count(), len(os.sched_getaffinity(0)), smoke)


def place_torchrun_ranks(*, smoke: bool) -> Placement:
    """`place_ranks` for the ranks torchrun started on this host (its environment)."""
    return place_ranks(int(os.environ["LOCAL_WORLD_SIZE"]), smoke=smoke)


def join(placement: Placement) -> torch.device:
    """In a rank (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_* set): take its device or its share
    of the cores, join the process group; this rank's device."""
    local = int(os.environ["LOCAL_RANK"])
    if placement.on_gpus:
        torch.cuda.set_device(local)
    else:
        torch.set_num_threads(placement.threads)
        os.environ["DS_ACCELERATOR"] = "cpu"  # see [Note: rank placement]
    dist.init_process_group(placement.backend)
    return placement.device(local)


def init_ranks(nproc: int, *, smoke: bool) -> tuple[Placement, torch.device]:
    """Relaunch this benchmark under torchrun on `nproc` ranks unless it already runs under
    torchrun (then its world counts), and join; where the ranks run and this rank's device."""
    if "LOCAL_RANK" not in os.environ:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
        cmd += [f"--nproc-per-node={nproc}", *entry_point(), *sys.argv[1:]]
        raise SystemExit(subprocess.call(cmd))
    placement = place_torchrun_ranks(smoke=smoke)
    return placement, join(placement)


def _spawned(
    rank: int, fn: Callable[..., None], placement: Placement, port: int, args: tuple[Any, ...]
) -> None:
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(placement.world),
        LOCAL_WORLD_SIZE=str(placement.world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    join(placement)
    fn(rank, placement.world, *args)
    dist.barrier()
    dist.destroy_process_group()


def spawn_ranks(fn: Callable[..., None], placement: Placement, args: tuple[Any, ...]) -> float:
    """Run `fn(rank, world, *args)` on `placement.world` spawned ranks, each joined to the
    process group; the seconds they took. `fn` and `args` must pickle (no `__main__`)."""
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    start = time.perf_counter()
    mp.start_processes(  # type: ignore[attr-defined, no-untyped-call]
        _spawned, args=(fn, placement, port, args), nprocs=placement.world, start_method="spawn"
    )
    return time.perf_counter() - start
