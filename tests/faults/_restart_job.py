"""examples/train_gpt.py under torchrun, with one fault injected per attempt.

Usage: torchrun ... tests/faults/_restart_job.py FAULTS [train_gpt.py options]
FAULTS is a comma-separated list ('-' for none); the i-th is injected in attempt i
(`TORCHELASTIC_RESTART_COUNT`), later attempts run clean:
- `step:S`   rank 1 is SIGKILLed in the forward of step S (mid-step);
- `async:S`  rank 1 is SIGKILLed right after the async save of step S started
             (its file is being written; nothing is committed);
- `commit:S` rank 0 is SIGKILLed at the rename that would commit step-S (sync saves:
             inside save_checkpoint; async: in the commit at the next save);
- `lose:S`   once step-S is committed, its rank 1 file is deleted and rank 1 SIGKILLed.
Only the kill is injected: saving, loading and training are the example's own code.
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import zeroshard.engine as zs

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def on_step_forward(step: int, act: Callable[[], None]) -> None:
    """Call `act` in the training forward of step `step` (steps counted from the one this
    attempt resumes at), by wrapping the example's `zs.initialize` and `resume_checkpoint`."""
    real_init, real_resume = zs.initialize, zs.resume_checkpoint
    first = [0]  # the step this attempt starts at

    def resume(*args: Any, **kwargs: Any) -> int | None:
        got = real_resume(*args, **kwargs)
        first[0] = got or 0
        return got

    def initialize(*args: Any, **kwargs: Any) -> Any:
        model, opt = real_init(*args, **kwargs)
        forwards = [0]

        def hook(module: nn.Module, _: Any) -> None:
            if module.training:  # one training forward per step (no accumulation)
                if first[0] + forwards[0] == step:
                    act()
                forwards[0] += 1

        model.register_forward_pre_hook(hook)
        return model, opt

    zs.initialize, zs.resume_checkpoint = initialize, resume  # type: ignore[assignment]


def _kill_rank1() -> None:
    if dist.get_rank() == 1:
        _die()


def after_save(step: int, act: Callable[[Any, dict[str, Any]], None]) -> None:
    real = zs.save_checkpoint

    def save(*args: Any, **kwargs: Any) -> Any:
        handle = real(*args, **kwargs)
        if kwargs["step"] == step:
            act(handle, kwargs)
        return handle

    zs.save_checkpoint = save  # type: ignore[assignment]


def _kill_async(handle: Any, kwargs: dict[str, Any]) -> None:
    _kill_rank1()


def _lose_file(handle: Any, kwargs: dict[str, Any]) -> None:
    if handle is not None:
        handle.wait()
    dist.barrier()
    root = Path(sys.argv[sys.argv.index("--ckpt-dir") + 1])
    if dist.get_rank() == 0:
        (root / f"step-{kwargs['step']}" / "rank00001.safetensors").unlink()
    dist.barrier()
    if dist.get_rank() == 1:
        _die()


def _kill_at_commit(step: int) -> None:
    real = os.rename

    def rename(src: Any, dst: Any, **kwargs: Any) -> None:
        if Path(src).name == f".step-{step}.tmp" and dist.get_rank() == 0:
            _die()
        real(src, dst, **kwargs)

    os.rename = rename  # type: ignore[assignment]


def main() -> None:
    faults = [] if sys.argv[1] == "-" else sys.argv[1].split(",")
    sys.argv = [str(EXAMPLES / "train_gpt.py"), *sys.argv[2:]]
    attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    if attempt < len(faults):
        kind, at = faults[attempt].split(":")
        step = int(at)
        if kind == "step":
            on_step_forward(step, _kill_rank1)
        elif kind == "async":
            after_save(step, _kill_async)
        elif kind == "commit":
            _kill_at_commit(step)
        elif kind == "lose":
            after_save(step, _lose_file)
        else:
            raise SystemExit(f"unknown fault {kind!r}")
    torch.set_num_threads(1)
    sys.path.insert(0, str(EXAMPLES))
    import train_gpt  # type: ignore[import-not-found]

    train_gpt.main()


if __name__ == "__main__":
    main()
