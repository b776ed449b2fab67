"""A node's snapshots in shared memory: one folder per step, one file per rank and kind.

[Note: a node's snapshots]
`{node folder}/step-{S}/own-rank{r}-of-{W}.snap` is rank r's own copy of its state at
step S in a world of W ranks, `replica-...` the copy a rank keeps for a rank of another
node (see [Note: the replica's rank]); `entry-...` and `entry-replica-...` are the same
for a journal entry of step S ([Note: the gradient journal] in _journal.py). A file is
written under a '.'-name and renamed once sealed (its checksum written), so a listed
file is whole unless damaged after. Every rank of a node sees the same folder: they
write different files, and a step's folder is removed only once no rank writes into it
(see [Note: snapshot lifecycle]).
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
from collections.abc import Iterable
from pathlib import Path
from typing import NamedTuple

OWN = "own"
REPLICA = "replica"
# A journal entry's files ([Note: the gradient journal] in _journal.py).
ENTRY = "entry"
ENTRY_REPLICA = "entry-replica"
_FILE = re.compile(r"(own|replica|entry|entry-replica)-rank(\d+)-of-(\d+)\.snap")
_STEP = re.compile(r"step-(\d+)")


def alive(pid: int) -> bool:
    """Whether process `pid` exists."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's
        return True
    return True


class Held(NamedTuple):
    """A snapshot file a node holds: rank `rank`'s state at `step` of `world_size` ranks."""

    step: int
    rank: int
    world_size: int
    kind: str
    size: int


class NodeStore:
    """The snapshot files in one node's folder."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder

    def path(self, step: int, rank: int, world_size: int, kind: str) -> Path:
        """Where a committed snapshot file lives."""
        return self.folder / f"step-{step}" / f"{kind}-rank{rank:05d}-of-{world_size:05d}.snap"

    def temp(self, final: Path) -> Path:
        """The '.'-name a file is written under before `commit`; its folder made."""
        final.parent.mkdir(parents=True, exist_ok=True)
        return final.with_name(f".{final.name}.{os.getpid()}.tmp")

    @staticmethod
    def commit(temp: Path, final: Path) -> None:
        """Put a sealed file in its place (atomic: a rename within the folder)."""
        os.rename(temp, final)

    def link(self, slot: Path, final: Path) -> None:
        """Put a sealed slot's bytes in place under `final` (a hard link, atomically)."""
        temp = self.temp(final)
        temp.unlink(missing_ok=True)
        os.link(slot, temp)
        self.commit(temp, final)

    def held(self) -> list[Held]:
        """Every committed snapshot file of this node, by step, rank and kind."""
        out = []
        for step_dir in self._steps():
            for f in step_dir.iterdir():
                m = _FILE.fullmatch(f.name)
                if m is None:
                    continue
                try:
                    size = f.stat().st_size
                except FileNotFoundError:  # removed by a rank of this node meanwhile
                    continue
                step = int(_STEP.fullmatch(step_dir.name).group(1))  # type: ignore[union-attr]
                out.append(Held(step, int(m.group(2)), int(m.group(3)), m.group(1), size))
        return sorted(out)

    def _steps(self) -> Iterable[Path]:
        if not self.folder.is_dir():
            return []
        return [d for d in self.folder.iterdir() if _STEP.fullmatch(d.name) and d.is_dir()]

    def drop(self, keep: int | None = None, *, before: bool = False) -> None:
        """Remove the folders of every step but `keep` (with `before`: only older ones)."""
        for d in self._steps():
            step = int(d.name.split("-")[1])
            if step == keep or (before and keep is not None and step > keep):
                continue
            shutil.rmtree(d, ignore_errors=True)  # another rank of the node may race us

    def keep_only(self, first: int, last: int) -> None:
        """Remove the folders of every step outside [first, last]."""
        for d in self._steps():
            if not first <= int(d.name.split("-")[1]) <= last:
                shutil.rmtree(d, ignore_errors=True)

    def remove(self) -> None:
        """Remove the node's folder and those of this job's agents on this host that are
        gone (a node lost and replaced here)."""
        shutil.rmtree(self.folder, ignore_errors=True)
        host, _ = self.folder.name.rsplit("-", 1)
        for other in self.folder.parent.glob(f"{host}-*"):
            pid = other.name.rsplit("-", 1)[1]
            if pid.isdigit() and not alive(int(pid)):
                shutil.rmtree(other, ignore_errors=True)

    def remove_job(self) -> None:
        """Remove the job's folder if no node's is left in it."""
        # Another node's folder may still be there, or the job's went already.
        with contextlib.suppress(OSError):
            self.folder.parent.rmdir()
