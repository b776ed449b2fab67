"""Whether a node's shared memory holds what its ranks' snapshots put there.

[Note: room in shared memory]
A snapshot's slots and replicas are files in `root` (tmpfs: /dev/shm) mapped into
memory. Writing into a mapped page tmpfs has no room for is a SIGBUS, a crash with no
message (Docker's /dev/shm is 64 MiB), so room is checked twice:
- `check_room`, collective, one ValueError on every rank: at `Snapshots(...)`, each
  node's need against its free space; a full snapshot's size is then a bound from below
  (its masters and module buffers: the optimizer's state is made by its first step, and
  the header and the user's state are small), and again, with each rank's exact size,
  at the first full snapshot after the construction or a resume, before its slots are
  made (every rank takes it at the same step, so the check meets on every rank).
- `made`: every file of shared memory has its pages reserved as it is made
  (`posix_fallocate`: tmpfs refuses at once with ENOSPC), so free space that shrank after
  the check (another job, a slot remade larger) is a named RuntimeError on that rank, not
  a SIGBUS at a later copy.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple

import torch

from zeroshard.engine.recovery._file import mapped
from zeroshard.engine.recovery._places import Placement

WAYS_OUT = (
    "a larger /dev/shm (docker run --shm-size=..., or a larger tmpfs), a root= elsewhere "
    "with room, or with the journal a smaller full_every (zeroshard-plan --snapshots "
    "prices it)"
)


class Need(NamedTuple):
    """One rank's: a full snapshot's bytes, a journal entry's (0 without a journal),
    and the free bytes under its node's `root`."""

    full: int
    entry: int
    free: int


def free_bytes(root: Path) -> int:
    """The free bytes of the filesystem that holds `root` (or would: a folder not made
    yet is its nearest existing parent's), as `os.statvfs` reads them."""
    at = root
    while not at.exists() and at != at.parent:
        at = at.parent
    stat = os.statvfs(at)
    return stat.f_bavail * stat.f_frsize


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB ({n:,} bytes)"


def check_room(
    placement: Placement,
    needs: Sequence[Need],
    full_every: int,
    root: Path,
    when: str,
) -> None:
    """ValueError (the same on every rank: `needs` are every rank's) unless each node's
    free space holds what it keeps in shared memory ([Note: room in shared memory]): two
    slots of each of its ranks' full snapshots and, while one is taken, two replicas of
    each of its wards' ([Note: the replica's rank]), each at that rank's own size; with a
    journal (`full_every` > 1) `full_every` entries of each of them too. `when` says
    which sizes these are (a bound at construction, exact at the first snapshot)."""
    for node in dict.fromkeys(placement.nodes):  # in the order of their first rank
        ranks = placement.node_ranks(node)
        wards = [w for r in ranks for w in placement.wards(r)]
        full = 2 * sum(needs[r].full for r in ranks + wards)
        journal = full_every * sum(needs[r].entry for r in ranks + wards) if full_every > 1 else 0
        need, free = full + journal, needs[ranks[0]].free
        if need <= free:
            continue
        parts = (
            f"{_gib(full)} for full snapshots (2 slots of each of its ranks {ranks} and 2 "
            f"replicas of each rank whose replicas they keep {wards}, while one is taken; a "
            f"full snapshot {_gib(max(needs[r].full for r in ranks + wards))} at most, "
            f"{when})"
        )
        if journal:
            entry = max(needs[r].entry for r in ranks + wards)
            parts += (
                f" and {_gib(journal)} for the journal ({full_every} entries of each of "
                f"them, an entry {_gib(entry)} at most)"
            )
        raise ValueError(
            f"Snapshots(full_every={full_every}): rank {ranks[0]}'s node needs "
            f"{_gib(need)} of shared memory, {parts}; {_gib(free)} are free in {root}: "
            f"{WAYS_OUT}"
        )


def made(path: Path, size: int, what: str) -> torch.Tensor:
    """A new file of shared memory at `path`, `size` bytes mapped, its pages reserved
    ([Note: room in shared memory]); RuntimeError naming `what` and the ways out when
    there is no room."""
    try:
        return mapped(path, size)
    except OSError as e:
        path.unlink(missing_ok=True)
        if e.errno not in (errno.ENOSPC, errno.ENOMEM):
            raise
        free = free_bytes(path.parent)
        raise RuntimeError(
            f"snapshots: no room for {what} of {_gib(size)} in {path.parent} "
            f"({e.strerror or e}; {_gib(free)} free now: the free space shrank after "
            f"Snapshots checked it, or the snapshot grew): {WAYS_OUT}"
        ) from e
