"""A torchrun worker that comes up, proves its group works, and dies until the last attempt.

Usage: torchrun ... tests/comm/_restart_worker.py LOG LAST_ATTEMPT
Each attempt joins the group with `zeroshard.comm.init_process_group`, all-reduces, and
appends "attempt A rank R up SUM" to LOG; rank 1 then SIGKILLs itself unless this is
attempt LAST_ATTEMPT, so torchrun restarts every worker.
"""

from __future__ import annotations

import datetime
import os
import signal
import sys

import torch
import torch.distributed as dist

from zeroshard.comm import init_process_group


def main(log: str, last: int) -> None:
    attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank = dist.get_rank()
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    with open(log, "a") as f:
        f.write(f"attempt {attempt} rank {rank} up {t.item():g}\n")
    if attempt < last:
        if rank == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        dist.barrier()  # fails once rank 1 is gone; torchrun then restarts everyone
        sys.exit(1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
