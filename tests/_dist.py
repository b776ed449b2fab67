"""The multi-process harness: run a test function on N ranks over real process groups.

`run_ranks(fn, world_size, ...)` spawns one process per rank, joins a gloo (CPU) or
NCCL (CUDA) process group on a free local port, calls `fn(*args)` on every rank and
re-raises, in the pytest process, every rank's exception with its traceback. A hard
deadline kills all ranks and fails the test instead of hanging CI; once one rank has
failed, the others get a short grace period (they may be stuck in a collective that
the failed rank never joined) and are then killed.

If another process takes the free port before rank 0 binds it, the ranks start again on
a new one (at most `PORT_ATTEMPTS` times).

`subtests(params)` is the product of a parameter dict; run it inside one spawn with
`run_each` so that a dozen combinations cost one process start, not a dozen.
"""

from __future__ import annotations

import contextlib
import datetime
import itertools
import multiprocessing as mp
import os
import queue
import socket
import time
import traceback
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

DEFAULT_TIMEOUT_S = 180.0
GRACE_AFTER_FAILURE_S = 10.0
PORT_ATTEMPTS = 3


def free_port() -> int:
    """Return a TCP port on the loopback that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _worker(
    fn: Callable[..., None],
    args: tuple[Any, ...],
    rank: int,
    world_size: int,
    port: int,
    device: str,
    pg_timeout_s: float,
    results: Any,
) -> None:
    import faulthandler

    import torch
    import torch.distributed as dist

    # A rank that crashes in native code prints its Python stack to the captured stderr.
    faulthandler.enable()
    # Two cores on CI: one intra-op thread per rank keeps ranks from fighting.
    torch.set_num_threads(1)
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    status: tuple[int, str | None] = (rank, None)
    try:
        backend = "gloo"
        if device == "cuda":
            torch.cuda.set_device(rank % torch.cuda.device_count())
            backend = "nccl"
        dist.init_process_group(
            backend,
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=pg_timeout_s),
        )
        fn(*args)
    except BaseException:
        status = (rank, traceback.format_exc())
    results.put(status)
    # The queue sends from a feeder thread: flush it before the hard exit below.
    results.close()
    results.join_thread()
    # Leave without tearing the process group down: a peer stuck in a collective must
    # not keep this rank alive, and the parent judges by the queue, not the exit code.
    os._exit(0)


def run_ranks(
    fn: Callable[..., None],
    world_size: int,
    *args: Any,
    device: str = "cpu",
    timeout_s: float = DEFAULT_TIMEOUT_S,
    pg_timeout_s: float = 120.0,
) -> None:
    """Run `fn(*args)` on `world_size` ranks; raise with every failing rank's traceback.

    `fn` must be importable by name (a module-level function) because ranks are
    spawned, not forked.
    """
    for _ in range(PORT_ATTEMPTS):
        failures, missing = _run_once(fn, world_size, args, device, timeout_s, pg_timeout_s)
        # Between `free_port` and rank 0's store binding it, another process (a parallel
        # test, NCCL's own sockets) may take the port: then no rank got past the
        # rendezvous, nothing of `fn` ran, and the same ranks go again on another port.
        rank0 = failures.get(0, "")
        if not ("EADDRINUSE" in rank0 and "init_process_group" in rank0):
            break
    if failures or missing:
        parts = [f"--- rank {r} ---\n{tb}" for r, tb in sorted(failures.items())]
        if missing:
            why = "after another rank failed" if failures else f"within {timeout_s:.0f}s"
            parts.append(f"ranks {missing} did not finish {why} and were killed")
        raise AssertionError(f"{len(failures)} of {world_size} ranks failed:\n" + "\n".join(parts))


def _run_once(
    fn: Callable[..., None],
    world_size: int,
    args: tuple[Any, ...],
    device: str,
    timeout_s: float,
    pg_timeout_s: float,
) -> tuple[dict[int, str], list[int]]:
    """Spawn the ranks once on a fresh port: each failing rank's traceback, and the ranks
    that never reported."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(
            target=_worker,
            args=(fn, args, rank, world_size, port, device, pg_timeout_s, results),
            name=f"rank{rank}",
            daemon=True,
        )
        for rank in range(world_size)
    ]
    for p in procs:
        p.start()
    failures: dict[int, str] = {}
    done: set[int] = set()
    deadline = time.monotonic() + timeout_s
    try:
        while len(done) < world_size:
            now = time.monotonic()
            if now > deadline:
                break
            try:
                rank, err = results.get(timeout=min(1.0, deadline - now))
            except queue.Empty:
                dead = [i for i, p in enumerate(procs) if not p.is_alive() and i not in done]
                # A rank that died without reporting (segfault, os._exit from inside fn).
                for i in dead:
                    with contextlib.suppress(queue.Empty):
                        rank, err = results.get(timeout=2.0)
                        done.add(rank)
                        if err is not None:
                            failures[rank] = err
                        continue
                    done.add(i)
                    failures[i] = f"rank {i} exited with code {procs[i].exitcode} without reporting"
                continue
            done.add(rank)
            if err is not None:
                failures[rank] = err
                deadline = min(deadline, time.monotonic() + GRACE_AFTER_FAILURE_S)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        for p in procs:
            p.join(timeout=5)
    return failures, sorted(set(range(world_size)) - done)


def subtests(params: Mapping[str, Sequence[Any]]) -> list[dict[str, Any]]:
    """The product of a parameter dict, as a list of keyword dicts."""
    keys = list(params)
    return [dict(zip(keys, values, strict=True)) for values in itertools.product(*params.values())]


def run_each(cases: Sequence[Mapping[str, Any]], body: Callable[..., None]) -> None:
    """Call `body(**case)` for every case on this rank; raise once, naming each failing case.

    Every rank runs every case in the same order, so collectives stay matched even when
    a case fails on one rank only (the body must not skip collectives on failure paths).
    """
    failed: list[str] = []
    for case in cases:
        try:
            body(**case)
        except Exception:
            failed.append(f"case {dict(case)}:\n{traceback.format_exc()}")
    if failed:
        raise AssertionError(f"{len(failed)} of {len(cases)} cases failed:\n" + "\n".join(failed))


@contextlib.contextmanager
def seeded(seed: int) -> Iterator[None]:
    """Fix torch's CPU (and CUDA) generators inside the block; restore them after."""
    import torch

    state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        yield
    finally:
        torch.random.set_rng_state(state)


def world_fits(device: str, world_size: int) -> None:
    """Skip a test whose world size needs more GPUs than this machine has."""
    if device != "cuda":
        return
    import pytest
    import torch

    if torch.cuda.device_count() < world_size:
        pytest.skip(f"world size {world_size} needs {world_size} GPUs")
