"""A rank's two snapshot buffers in shared memory, written step after step.

[Note: slots]
A snapshot is written into one of the rank's two slot files (`slots/` in the node's
folder, named by rank and process), each mapped once and, with CUDA, registered once as
pinned memory, so device tensors are copied straight into shared memory (no staging
buffer, no second copy) and pages are not faulted in anew at every step. That costs
seconds per slot at a large model's GiBs (the kernel zeroes the pages, cudaHostRegister
or a first write faults them in), so the first take of a size maps every slot of its
kind at once (both full ones; the journal's whole ring) and faults their pages in: later
takes pay none of it. A slot keeps its size: the header is padded to fill it
(`_file.plan`'s `room`), so a header a few bytes longer (a scheduler's learning rate
printed longer, the user's state) does not make a new slot. The committed snapshot is a
hard link to the slot file, under the step's name ([Note: a node's snapshots]). The two
slots alternate: the one written next held the step before the newest complete one,
whose folder was removed when the newest completed. A restarted process never writes
into a dead process's slots (their steps may still be linked and needed): it makes its
own, and removes the dead ones' names (their bytes live on while a step links them). The
journal's entries have a ring of K slots of their own ([Note: snapshot lifecycle] in
_snapshots.py).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch

from zeroshard.comm import warn_tagged
from zeroshard.engine.recovery._room import made
from zeroshard.engine.recovery._store import NodeStore, alive


@dataclass
class Slot:
    """One slot file and its mapping (`pinned`: registered with CUDA)."""

    path: Path
    buf: torch.Tensor
    pinned: bool


def _pin(buf: torch.Tensor) -> int:
    """Register `buf` with CUDA as pinned; the CUDA error (0: registered)."""
    cudart = torch.cuda.cudart()  # type: ignore[no-untyped-call]
    return int(cudart.cudaHostRegister(buf.data_ptr(), buf.numel(), 0))


def _unpin(slot: Slot) -> None:
    if slot.pinned:
        torch.cuda.cudart().cudaHostUnregister(slot.buf.data_ptr())  # type: ignore[no-untyped-call]
        slot.pinned = False


class Slots:
    """This process's `count` slots for rank `rank` in `store`'s node folder, their file
    names tagged `tag` (two for full snapshots; the journal's ring)."""

    def __init__(
        self, store: NodeStore, rank: int, pin: bool, count: int = 2, tag: str = ""
    ) -> None:
        self._folder = store.folder / "slots"
        self._rank = rank
        self._pin = pin
        self._tag = tag
        self._slots: list[Slot | None] = [None] * count
        self._turn = 0
        self._folder.mkdir(parents=True, exist_ok=True)
        for f in self._folder.glob("rank*-*-*.buf"):
            pid = f.name.split("-")[1]
            if pid.isdigit() and not alive(int(pid)):
                f.unlink(missing_ok=True)

    def next(self, size: int) -> Slot:
        """The slot to write a snapshot of `size` bytes into (see [Note: slots])."""
        k, self._turn = self._turn, (self._turn + 1) % len(self._slots)
        return self.at(k, size)

    def room(self, k: int | None = None) -> int | None:
        """The size of slot `k` (None: the one `next` returns); None before it is mapped."""
        slot = self._slots[self._turn if k is None else k]
        return None if slot is None else slot.buf.numel()

    def at(self, k: int, size: int) -> Slot:
        """Slot `k`, holding `size` bytes."""
        slot = self._slots[k]
        if slot is not None and slot.buf.numel() == size:
            return slot
        # Every slot not mapped yet too (see [Note: slots]); one mapped at another size
        # may still be written: it waits for its own turn.
        for j, other in enumerate(self._slots):
            if other is None and j != k:
                self._slots[j] = self._map(j, size)
        if slot is not None:
            _unpin(slot)
        new = self._map(k, size)
        self._slots[k] = new
        return new

    def _map(self, k: int, size: int) -> Slot:
        # A new file, not the old one resized: a step may still link the old bytes.
        path = self._folder / f"rank{self._rank:05d}-{os.getpid()}-{self._tag}{k}.buf"
        path.unlink(missing_ok=True)
        what = f"rank {self._rank}'s {'journal entry' if self._tag else 'snapshot'} slot"
        buf = made(path, size, what)  # pages reserved: [Note: room in shared memory]
        err = _pin(buf) if self._pin else 0  # which faults every page in
        if self._pin and err:
            # Linux (6.5 on) page-locks a writable shared file mapping for good only in
            # tmpfs (/dev/shm) or hugetlbfs: elsewhere CUDA refuses (invalid value). The
            # slot then stays pageable, and each device copy into it waits on the host.
            warn_tagged(
                f"snapshots: {self._folder} cannot be pinned for the GPU's copies (CUDA "
                f"error {err}; pinning needs a tmpfs such as /dev/shm): snapshots copy "
                "through pageable memory and take() waits for the device"
            )
            self._pin = False
        if not self._pin:
            # Fault every page in now, not in the take that first copies into the slot
            # ([Note: slots]); faults on first write measured cheaper than MAP_POPULATE
            # here (1.4 against 1.75 s a GiB on a CPU host, the kernel's zeroing included).
            buf.zero_()
        return Slot(path, buf, self._pin)

    def close(self) -> None:
        """Unregister and drop both slots (their files go with the node's folder)."""
        for slot in self._slots:
            if slot is not None:
                _unpin(slot)
        self._slots = [None] * len(self._slots)
