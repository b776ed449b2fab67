"""Small agreement collectives for save and load: every rank reaches the same outcome.

A save must never leave one rank waiting in a barrier that a failed rank will not
reach, so each step ends with an all-gather of a few integers (a failure flag and,
at commit, each file's size and checksum) instead of a bare barrier. Without a
process group (a single process) the same calls are local.

[Note: one outcome]
A failure seen by one rank only (its shard file is truncated, its disk is full) must
not let the others carry on: a `try: load / except: start fresh` loop would then train
with mixed weights. `Agreement.outcome` all-gathers each rank's error (its class and
the first bytes of its message), and every rank raises the same error, naming the
failing rank and what it saw, or every rank goes on.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch
import torch.distributed as dist

from zeroshard.ckpt._errors import (
    CheckpointError,
    ChecksumError,
    FormatVersionError,
    MissingShardError,
    ModelMismatchError,
    OutputExistsError,
)
from zeroshard.comm import Group

T = TypeVar("T")

# Index 0 stands for "no error"; an error of another class travels as CheckpointError.
_SHARED_ERRORS: tuple[type[CheckpointError], ...] = (
    CheckpointError,
    FormatVersionError,
    ChecksumError,
    MissingShardError,
    ModelMismatchError,
    OutputExistsError,
)
_MESSAGE_BYTES = 1024


class Agreement:
    """All-gathers of small int64 vectors over a `Group`, or locally for one process."""

    def __init__(self, group: Group | None) -> None:
        if group is None and dist.is_available() and dist.is_initialized():
            group = Group()
        self._group = group

    @property
    def rank(self) -> int:
        """This process's rank (0 without a process group)."""
        return 0 if self._group is None else self._group.rank

    @property
    def size(self) -> int:
        """The number of ranks (1 without a process group)."""
        return 1 if self._group is None else self._group.size

    def gather(self, values: list[int], label: str) -> list[list[int]]:
        """Every rank's `values` (same length everywhere), in rank order; also a barrier."""
        if self._group is None:
            return [list(values)]
        g = self._group
        send = torch.tensor(values, dtype=torch.int64, device=g.device)
        recv = torch.empty(len(values) * g.size, dtype=torch.int64, device=g.device)
        g.all_gather_into(recv, send, label=label).wait()
        rows = recv.view(g.size, len(values)).tolist()
        return [[int(x) for x in row] for row in rows]

    def outcome(self, error: BaseException | None, label: str) -> None:
        """Raise on every rank the first failing rank's error, or return on every rank.

        See [Note: one outcome]. The failing rank raises it chained to its own error.
        """
        code, text = 0, b""
        if error is not None:
            kind = type(error)
            code = 1 + (_SHARED_ERRORS.index(kind) if kind in _SHARED_ERRORS else 0)
            text = f"{type(error).__name__}: {error}".encode()[:_MESSAGE_BYTES]
        row = [code, len(text), *text, *([0] * (_MESSAGE_BYTES - len(text)))]
        rows = self.gather(row, f"{label}: outcome")
        bad = [r for r, got in enumerate(rows) if got[0]]
        if not bad:
            return
        first = rows[bad[0]]
        cls = _SHARED_ERRORS[first[0] - 1]
        message = bytes(first[2 : 2 + first[1]]).decode(errors="replace")
        shared = cls(f"{label} failed on rank(s) {bad}; rank {bad[0]}: {message}")
        raise shared from error


def agreed(group: Group | None, label: str, fn: Callable[[], T]) -> T:
    """`fn()` on every rank, with one outcome: its result everywhere, or the same error."""
    ag = Agreement(group)
    try:
        result = fn()
    except Exception as e:
        ag.outcome(e, label)
        raise  # unreachable: outcome raised for this failing rank
    ag.outcome(None, label)
    return result
