"""Where a rank puts the replicas it keeps for its wards ([Note: the replica's rank] in
_places.py).

[Note: the replicas' ring]
A replica of a full snapshot is a file of its own, written under a '.'-name and renamed
in once its trailer is there. A replica of a journal entry is written into a ring of K
slots per ward (`Slots`, [Note: slots]), the owner's own entries' ring mirrored: every
rank takes its entries at the same steps, so the ward's n-th entry since the start (or
the resume) goes into the same place k = n mod K as the keeper's own, and is linked in
under its step's name once received whole. Slot k is written again only by the entry
K entries later, whose replication follows, in the snapshots' step order ([Note:
snapshots in the background]), that of a full snapshot taken between the two: the old
entry's step is then complete and unneeded, as an owner's slot is when it is reused. So
a rank keeps K entry replicas per ward whatever the run's length, mapped once, instead
of a new file of shared memory at every step.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from zeroshard.engine.recovery._room import made
from zeroshard.engine.recovery._slots import Slots
from zeroshard.engine.recovery._store import ENTRY_REPLICA, REPLICA, NodeStore


class Replicas:
    """The replicas rank `rank` keeps for `wards` in `store`, a ring of `full_every`
    entries per ward where `full_every` > 1 (see [Note: the replicas' ring])."""

    def __init__(self, store: NodeStore, rank: int, wards: Sequence[int], full_every: int) -> None:
        self._store = store
        self._rings = (
            {w: Slots(store, rank, False, full_every, f"replica{w}-") for w in wards}
            if full_every > 1
            else {}
        )

    def place(
        self, step: int, ward: int, world_size: int, size: int, entry: bool, ring: int | None
    ) -> tuple[torch.Tensor, Callable[[], None]]:
        """Where `ward`'s `size` bytes of `step` (a journal `entry`, at place `ring` of the
        ring; None: a file of its own) are received, and what puts them in place once they
        are whole."""
        final = self._store.path(step, ward, world_size, ENTRY_REPLICA if entry else REPLICA)
        if ring is not None and ward in self._rings:
            slot = self._rings[ward].at(ring, size)
            return slot.buf, lambda: self._store.link(slot.path, final)
        temp = self._store.temp(final)
        what = f"rank {ward}'s replica of step {step}"
        return made(temp, size, what), lambda: self._store.commit(temp, final)

    def close(self) -> None:
        """Drop the rings' mappings (their files go with the node's folder)."""
        for ring in self._rings.values():
            ring.close()
