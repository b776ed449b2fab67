"""Warnings a multi-rank job shows once, on rank 0, pointing at the user's line.

[Note: rank-aware warnings]
Every rank runs the same code, so a warning about something that is the same on every
rank (a config choice, a model that cannot be compiled) would print once per rank.
`warn_on_rank0` shows it on rank 0 only. `warn_tagged` is for a condition that may
differ per rank (pinning host memory failed here): every rank that meets it warns, with
its rank in the message. Both point at the first frame outside zeroshard and torch, the
user's line, so no `stacklevel` is counted by hand (a count is wrong as soon as a second
call path reaches the same warning).
"""

from __future__ import annotations

import sys
import warnings

import torch.distributed as dist

_LIBRARIES = ("zeroshard.", "torch.")


def process_rank() -> int | None:
    """This process's rank in the default process group, or None without one."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return None


def is_rank0() -> bool:
    """Whether this process is rank 0, or runs without a process group."""
    return process_rank() in (None, 0)


def _user_stacklevel() -> int:
    """`warnings.warn`'s stacklevel, called from a `warn_*` here, of the first user frame."""
    # 1 is the warn_* function itself, 2 its caller inside zeroshard, and so on.
    level, frame = 2, sys._getframe(2)
    while frame.f_back is not None and str(frame.f_globals.get("__name__", "")).startswith(
        _LIBRARIES
    ):
        frame = frame.f_back
        level += 1
    return level


def warn_on_rank0(message: str, category: type[Warning] = UserWarning) -> None:
    """Warn on rank 0 only (see [Note: rank-aware warnings])."""
    if is_rank0():
        warnings.warn(message, category, stacklevel=_user_stacklevel())


def warn_tagged(message: str, category: type[Warning] = UserWarning) -> None:
    """Warn on this rank, naming it (see [Note: rank-aware warnings])."""
    rank = process_rank()
    tagged = message if rank is None else f"[rank {rank}] {message}"
    warnings.warn(tagged, category, stacklevel=_user_stacklevel())
