"""A rank of a 2-process job run as its own interpreter, for faults the harness cannot
host (a rank that dies, a rank whose normal interpreter exit is measured).

Usage: python -m tests.faults._peer MODE RANK PORT
"""

from __future__ import annotations

import datetime
import os
import sys
import time

import torch
import torch.distributed as dist

from tests.faults._engine import build, train_step
from zeroshard.comm import CollectiveTimeoutError

PEER_SLEEP_S = 60.0


def main(mode: str, rank: int, port: int) -> int:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=2,
        timeout=datetime.timedelta(seconds=120),
    )
    model, opt = build(2)
    if mode == "crash" and rank == 1:
        os._exit(3)  # dies mid-step: after initialize, before its first gradient reduce
    if mode == "stall" and rank == 1:
        time.sleep(PEER_SLEEP_S)  # alive, never answering
        return 0
    start = time.monotonic()
    try:
        train_step(model, opt, 0)
    except CollectiveTimeoutError as e:
        print(f"ERROR {time.monotonic() - start:.2f} {e}", flush=True)
        return 0  # a normal interpreter exit follows: it must not wait for the peer
    print("NO ERROR", flush=True)
    return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3])))
