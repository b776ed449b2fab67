"""Rank pairs that catch zeroshard's agreed error and exit with a status of their own.

Usage: python -m tests.faults._exit_cases CASE REPEATS CONCURRENT
Prints one line, ``STATUSES <json list>``: every rank's exit status (`CHOSEN` expected).

Each rank is forked from this process after torch and zeroshard are imported (a fresh
interpreter costs seconds on a busy machine), then returns from `rank_main` through
``sys.exit``: a real interpreter exit, with atexit hooks and finalization, which is what
is measured. No thread exists in this process when it forks.
"""

from __future__ import annotations

import datetime
import gc
import json
import os
import resource
import shutil
import signal
import socket
import sys
import tempfile
import time

import torch
import torch._dynamo  # the first optimizer imports it: do so once, before forking
import torch.distributed as dist

import zeroshard.engine as zs
from tests.faults._engine import TIMEOUT_S, build, train_step
from zeroshard.ckpt import CheckpointError
from zeroshard.comm import CollectiveTimeoutError

CHOSEN = 7
CASES = ("initialize", "load", "save", "timeout")


def rank_main(case: str, rank: int, port: int, root: str) -> int:
    """One rank of `case`: the agreed error is caught and the script returns `CHOSEN`."""
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=2,
        timeout=datetime.timedelta(seconds=60),
    )
    try:
        if case == "initialize":  # the ranks disagree on the stage
            build(2 if rank == 0 else 3)
        elif case == "load":  # nothing to load there
            model, opt = build(2)
            zs.load_checkpoint(model, opt, root)
        elif case == "save":  # rank 1's disk is full
            model, opt = build(2)
            if rank == 1:
                signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
                resource.setrlimit(resource.RLIMIT_FSIZE, (1024, resource.RLIM_INFINITY))
            zs.save_checkpoint(model, opt, root, step=1)
        else:  # rank 1 skips the step's gradient reduce-scatter, alive meanwhile
            model, opt = build(2)
            if rank == 1:
                time.sleep(TIMEOUT_S + 3)
                return CHOSEN
            train_step(model, opt, 0)
    except (ValueError, CheckpointError, CollectiveTimeoutError) as e:
        print(f"rank {rank} caught {type(e).__name__}: {e}", flush=True)
        return CHOSEN
    print(f"rank {rank}: no error", flush=True)
    return 1


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _fork_rank(case: str, rank: int, port: int, root: str, log: str) -> int:
    pid = os.fork()
    if pid:
        return pid
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    sys.exit(rank_main(case, rank, port, root))


def main(case: str, repeats: int, concurrent: int) -> None:
    if case not in CASES:
        raise SystemExit(f"unknown case {case!r}; expected one of {CASES}")
    # What the children inherit is never collected by them: their exit is quicker.
    gc.freeze()
    logs = tempfile.mkdtemp(prefix=f"zeroshard-exit-{case}-")
    statuses: list[int] = []
    for first in range(0, repeats, concurrent):
        running = []
        for i in range(first, min(first + concurrent, repeats)):
            port, root = _free_port(), tempfile.mkdtemp(prefix="zeroshard-exit-ck-")
            for rank in (0, 1):
                log = os.path.join(logs, f"{i}.rank{rank}")
                running.append((_fork_rank(case, rank, port, root, log), log, root))
        for pid, log, root in running:
            status = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
            statuses.append(status)
            if status != CHOSEN:
                with open(log) as f:
                    print(f"--- {log}: exit status {status}\n{f.read()[-3000:]}", flush=True)
            shutil.rmtree(root, ignore_errors=True)
    shutil.rmtree(logs, ignore_errors=True)
    print("STATUSES", json.dumps(statuses), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
