"""examples/train_gpt.py with `--snapshot-every` under torchrun, one fault per attempt.

Usage: torchrun ... tests/faults/_snapshot_job.py FAULTS [train_gpt.py options]
FAULTS is a comma-separated list ('-' for none); the i-th is injected in attempt i
(`TORCHELASTIC_RESTART_COUNT`), later attempts run clean:
- `step:S`     rank 1 is SIGKILLed in the forward of step S (mid-step);
- `own:S`      rank 1 is SIGKILLed as its own snapshot of step S (written and sealed)
               is renamed into place: mid-snapshot, step S is not complete;
- `entry:S`    rank 1 is SIGKILLed as its own journal entry of step S is renamed into
               place (`--snapshot-full-every`): step S is not complete;
- `replica:S`  rank 0 is SIGKILLed as the replica of rank 1's step S it received is
               renamed into place: mid-replication;
- `send:S`     rank 1 is SIGKILLed once it has started sending its bytes of step S (a
               snapshot or a journal entry) to the rank keeping its replica, before the
               send is waited for: mid-replication, the bytes in flight;
- `flip:S`     once step S is complete, one bit of rank 1's own snapshot (or journal
               entry) is flipped and rank 1 SIGKILLed;
- `flipall:S`  the same, rank 1's replica flipped too: memory covers no step;
- `pause:S:NAME` (node tests) every worker of this agent, in the forward of step S,
               writes its pid to NAME-{LOCAL_RANK}.pid and sleeps: the test SIGKILLs
               the agent and its workers;
- `first`      (node tests) local rank 0 is SIGKILLed in the first forward.
Steps count from 0; the snapshot of step S holds the state after S steps. Only the
kill (and the flipped bit) is injected: snapshots, restore and training are the
example's own code.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import zeroshard.engine as zs
from zeroshard.engine.recovery import _wire
from zeroshard.engine.recovery._store import ENTRY, ENTRY_REPLICA, OWN, REPLICA

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _on_forward(step: int | None, act: Callable[[], None]) -> None:
    """Call `act` in the training forward of step `step` (None: the attempt's first),
    once the snapshot taken before it is complete: "mid-step" is then S however slowly
    the background replication ran (a loaded machine made it S - 1 otherwise)."""
    real_init, real_resume = zs.initialize, zs.Snapshots.resume
    first = [0]  # the step this attempt starts at
    snapshots: list[zs.Snapshots] = []

    def resume(self: zs.Snapshots, directory: Any) -> int | None:
        got = real_resume(self, directory)
        first[0] = got or 0
        snapshots.append(self)
        return got

    def initialize(*args: Any, **kwargs: Any) -> Any:
        model, opt = real_init(*args, **kwargs)
        forwards = [0]

        def hook(module: nn.Module, _: Any) -> None:
            if module.training:  # one training forward per step (no accumulation)
                if (step is None and forwards[0] == 0) or first[0] + forwards[0] == step:
                    for snaps in snapshots:
                        snaps.wait()
                    act()
                forwards[0] += 1

        model.register_forward_pre_hook(hook)
        return model, opt

    zs.initialize = initialize  # type: ignore[assignment]
    zs.Snapshots.resume = resume  # type: ignore[method-assign]


def _at_rename(kind: str, step: int, rank: int) -> None:
    """SIGKILL rank `rank` as the `kind` snapshot of rank 1 at `step` is renamed in."""
    real = os.rename
    name = f"{kind}-rank00001-of-00002.snap"

    def rename(src: Any, dst: Any, **kwargs: Any) -> None:
        dst = Path(dst)
        if dst.name == name and dst.parent.name == f"step-{step}" and dist.get_rank() == rank:
            _die()
        real(src, dst, **kwargs)

    os.rename = rename  # type: ignore[assignment]


def _mid_send(step: int) -> None:
    """SIGKILL rank 1 once it has started sending its bytes of `step` to its buddy."""
    real_header, real_bytes = _wire.send_header, _wire.send_bytes
    sending = [-1]  # the step of the header sent last

    def send_header(pg: Any, values: Any, dst: int) -> _wire.Works:
        sending[0] = values[0]
        return real_header(pg, values, dst)

    def send_bytes(pg: Any, buf: torch.Tensor, dst: int) -> _wire.Works:
        works = real_bytes(pg, buf, dst)
        if sending[0] == step and dist.get_rank() == 1:
            _die()
        return works

    _wire.send_header = send_header  # type: ignore[assignment]
    _wire.send_bytes = send_bytes  # type: ignore[assignment]


def _flip_after(step: int, kinds: tuple[str, ...]) -> None:
    """Once snapshot `step` is complete, flip a bit of rank 1's files of `kinds` (its
    own copy, a snapshot's or an entry's, on rank 1; a replica on rank 0, whose node
    holds it) and SIGKILL rank 1."""
    real = zs.Snapshots.take

    def take(self: zs.Snapshots, at: int) -> bool:
        took = real(self, at)
        if at == step:
            self.wait()
            dist.barrier()
            for kind in kinds:
                path = self.store.path(step, 1, 2, kind)
                if path.exists() and (kind in (OWN, ENTRY)) == (dist.get_rank() == 1):
                    data = bytearray(path.read_bytes())
                    data[len(data) // 2] ^= 0x04
                    path.write_bytes(data)
            dist.barrier()
            if dist.get_rank() == 1:
                _die()
        return took

    zs.Snapshots.take = take  # type: ignore[method-assign]


def _pause(step: int, name: str) -> None:
    marker = Path(f"{name}-{os.environ['LOCAL_RANK']}.pid")

    def pause() -> None:
        marker.write_text(str(os.getpid()))
        while True:
            time.sleep(1)

    _on_forward(step, pause)


def main() -> None:
    faults = [] if sys.argv[1] == "-" else sys.argv[1].split(",")
    sys.argv = [str(EXAMPLES / "train_gpt.py"), *sys.argv[2:]]
    attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    if attempt < len(faults):
        kind, *at = faults[attempt].split(":")
        rank1 = lambda: _die() if dist.get_rank() == 1 else None  # noqa: E731
        if kind == "step":
            _on_forward(int(at[0]), rank1)
        elif kind == "own":
            _at_rename(OWN, int(at[0]), 1)
        elif kind == "entry":
            _at_rename(ENTRY, int(at[0]), 1)
        elif kind == "replica":
            _at_rename(REPLICA, int(at[0]), 0)
        elif kind == "send":
            _mid_send(int(at[0]))
        elif kind == "flip":
            _flip_after(int(at[0]), (OWN, ENTRY))
        elif kind == "flipall":
            _flip_after(int(at[0]), (OWN, REPLICA, ENTRY, ENTRY_REPLICA))
        elif kind == "pause":
            _pause(int(at[0]), at[1])
        elif kind == "first":
            _on_forward(None, lambda: _die() if os.environ["LOCAL_RANK"] == "0" else None)
        else:
            raise SystemExit(f"unknown fault {kind!r}")
    torch.set_num_threads(1)
    sys.path.insert(0, str(EXAMPLES))
    import train_gpt  # type: ignore[import-not-found]

    train_gpt.main()


if __name__ == "__main__":
    main()
