"""examples/train_gpt.py under one torchrun agent (a "node") of a multi-node job.

Usage: torchrun ... tests/faults/_node_job.py ACTION [train_gpt.py options]
ACTION is one of:
- `-`            no fault;
- `stop:S`       every rank exits with status 0 once the save of step-S is committed
                 (a job that ends there: the reference run changes world size at S);
- `pause:S:NAME` the first time each worker of this agent reaches the forward of step S
                 (over all its attempts: marked by a file), it writes its pid to
                 NAME-{LOCAL_RANK}.pid in the working directory and sleeps: the test
                 SIGKILLs it, or its agent stops it to restart.
Local rank 0 prints the agent's `TORCHELASTIC_RESTART_COUNT` and the world size.
Only the fault is injected: saving, loading and training are the example's own code.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

# A sibling module: torchrun runs this file as a script, its folder first on sys.path.
from _restart_job import after_save, on_step_forward  # type: ignore[import-not-found]

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def _pause_in_step(step: int, name: str) -> None:
    marker = Path(f"{name}-{os.environ['LOCAL_RANK']}.pid")
    if marker.exists():  # paused in an earlier attempt of this agent
        return

    def pause() -> None:
        marker.write_text(str(os.getpid()))
        while True:
            time.sleep(1)

    on_step_forward(step, pause)


def _stop(handle: Any, kwargs: dict[str, Any]) -> None:
    sys.exit(0)  # a sync save returns once committed on every rank


def main() -> None:
    raw = sys.argv[1]
    action = raw.split(":")
    sys.argv = [str(EXAMPLES / "train_gpt.py"), *sys.argv[2:]]
    if action[0] == "stop":
        after_save(int(action[1]), _stop)
    elif action[0] == "pause":
        _pause_in_step(int(action[1]), action[2])
    elif action != ["-"]:
        raise SystemExit(f"unknown action {raw!r}")
    if os.environ["LOCAL_RANK"] == "0":  # which attempt this agent thinks it runs
        count, world = os.environ["TORCHELASTIC_RESTART_COUNT"], os.environ["WORLD_SIZE"]
        print(f"_node_job: restart count {count} at world {world}", file=sys.stderr, flush=True)
    torch.set_num_threads(1)
    sys.path.insert(0, str(EXAMPLES))
    import train_gpt  # type: ignore[import-not-found]

    train_gpt.main()


if __name__ == "__main__":
    main()
