"""Small agreement collectives for save: every rank learns whether any rank failed.

A save must never leave one rank waiting in a barrier that a failed rank will not
reach, so each step ends with an all-gather of a few integers (a failure flag and,
at commit, each file's size and checksum) instead of a bare barrier. Without a
process group (a single process) the same calls are local.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from zeroshard.comm import Group


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

    def failed_ranks(self, failed: bool, label: str) -> list[int]:
        """The ranks that report failure (every rank gets the same list)."""
        return [r for r, (flag,) in enumerate(self.gather([int(failed)], label)) if flag]
