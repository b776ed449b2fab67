"""Start the ranks of a benchmark: relaunch under torchrun, or spawn them; join the group."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from benchmarks._common._report import entry_point


def _join(cuda: bool) -> torch.device:
    """Join the process group of this rank (NCCL with `cuda`, else gloo); its device."""
    local = int(os.environ["LOCAL_RANK"])
    if cuda:
        torch.cuda.set_device(local)
    else:
        torch.set_num_threads(1)  # ranks share the host's cores
    dist.init_process_group("nccl" if cuda else "gloo")
    return torch.device("cuda", local) if cuda else torch.device("cpu")


def init_ranks(nproc: int, *, cuda: bool) -> torch.device:
    """Relaunch this script under torchrun on `nproc` ranks unless it already is, then join
    the process group (NCCL with `cuda`, else gloo) and return this rank's device."""
    if "LOCAL_RANK" not in os.environ:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
        cmd += [f"--nproc-per-node={nproc}", *entry_point(), *sys.argv[1:]]
        raise SystemExit(subprocess.call(cmd))
    return _join(cuda)


def _spawned(
    rank: int, fn: Callable[..., None], world: int, port: int, cuda: bool, args: Any
) -> None:
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    _join(cuda)
    fn(rank, world, *args)
    dist.barrier()
    dist.destroy_process_group()


def spawn_ranks(fn: Callable[..., None], world: int, *, cuda: bool, args: tuple[Any, ...]) -> float:
    """Run `fn(rank, world, *args)` on `world` spawned ranks, each in the process group
    (NCCL with `cuda`, else gloo); the seconds they took. `fn` and `args` must pickle."""
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    start = time.perf_counter()
    mp.start_processes(  # type: ignore[attr-defined, no-untyped-call]
        _spawned, args=(fn, world, port, cuda, args), nprocs=world, start_method="spawn"
    )
    return time.perf_counter() - start
