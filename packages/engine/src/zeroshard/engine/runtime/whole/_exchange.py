"""`MatrixExchange`: one flat group's matrices between the ranks' shards and their owners.

[Note: the owner's buffer]
A matrix that lies whole in its owner's shard never moves: the owner steps a view of its
shard (`local`). The others (`exchanged`, the same set on every rank) travel in one
all-to-all per direction over the group's process group. Each rank sends, to each owner
in rank order, its pieces of that owner's matrices in offset order; the owner receives
them in rank order, and since rank r's shard is the r-th range of the flat buffer, what
it receives is its exchanged matrices in offset order, each contiguous (row-major, as
the parameter flattens): one buffer of views, no reordering. The way back sends that
buffer with the same split sizes, and each rank copies the pieces it receives to where
they came from in its shard.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from zeroshard.comm import Group, Handle
from zeroshard.engine.runtime._flat_group import FlatParamGroup
from zeroshard.engine.runtime._stepper import AfterBackward
from zeroshard.engine.runtime._tensor_parallel import TensorParallel
from zeroshard.engine.runtime.whole._owners import MatrixOwners
from zeroshard.partition import FlatLayout, Slot

# [Note: whole-matrix steps are collectives]
# A whole-matrix optimizer's step of a flat group is a collective over its process group:
# the all-to-all that brings each matrix (its gradient or update) to its owner and back.
# Every rank must enter a group's collectives in the same order. Under step_in_backward
# CPU offload steps groups on the stepping thread as their gradients land, while the main
# thread issues backward's reduce-scatters on the same group: two threads' collectives on
# one group interleave in an order each rank decides by its own timing, so the ranks would
# pair one rank's all-to-all with another's reduce-scatter. Issued on the main thread
# instead, from the reducer's hook once a group's gradient is in, the order would hold
# (every rank runs the hooks in the reducer's order), but backward would wait there for
# the exchange and the owner's Newton-Schulz: the plain step's work moved into backward,
# nothing overlapped. So the matrices step at `step()`, after backward: beside an
# optimizer whose offloaded groups step in backward they wait for it (`AfterBackward`),
# alone they refuse step_in_backward (nothing would step in it). delay_param_update: its
# thread runs no collective; the whole-matrix groups are stepped at `step()` on the main
# thread, before the delayed step starts, and published with the delayed weights at the
# next `step()` ([Note: delayed parameter update] in offload/_step.py).
WHOLE_STEP_IS_COLLECTIVE = (
    "a whole-matrix optimizer's step of a group is a collective over its process group "
    "(each matrix to its owner and back), which the stepping thread would issue beside "
    "backward's reduce-scatters on the same group, in an order the ranks do not agree on; "
    "its matrices step at step(), beside another optimizer's groups stepped in backward, "
    "and alone nothing would: step after backward (without step_in_backward)"
)


@dataclass(frozen=True)
class ShardPiece:
    """Elements [start, start + numel) of this rank's shard: part of `slot`."""

    slot: Slot
    start: int
    numel: int


class MatrixExchange:
    """Moves the matrices of one flat group between the shards and their owners (see
    [Note: the owner's buffer])."""

    def __init__(self, layout: FlatLayout, owner: Mapping[str, int], group: Group) -> None:
        self.group = group
        me, n = group.rank, layout.shard_numel
        lo = me * n
        whole = {s.name for s in layout.slots if _in_shard(layout, s, owner[s.name])}
        mine = [s for s in layout.slots if owner[s.name] == me and s.numel]
        # Matrices this rank steps from a view of its own shard: [start, start + numel).
        self.local = [ShardPiece(s, s.offset - lo, s.numel) for s in mine if s.name in whole]
        exchanged = [s for s in layout.slots if s.numel and s.name not in whole]
        self.active = bool(exchanged)
        # This rank's owned exchanged matrices, in offset order (the owner's buffer).
        self.owned = [s for s in exchanged if owner[s.name] == me]
        self.owned_numel = sum(s.numel for s in self.owned)
        sends: list[list[ShardPiece]] = [[] for _ in range(group.size)]
        recv = [0] * group.size
        for s in exchanged:
            for piece in layout.pieces(s):
                if piece.rank == me:
                    sends[owner[s.name]].append(ShardPiece(s, piece.shard_start, piece.numel))
                if owner[s.name] == me:
                    recv[piece.rank] += piece.numel
        # What this rank sends, owner by owner: the pieces it gets back, in that order.
        self.pieces = [p for per_owner in sends for p in per_owner]
        self.send_splits = [sum(p.numel for p in per_owner) for per_owner in sends]
        self.recv_splits = recv

    def stepped_here(self) -> list[Slot]:
        """The matrices this rank steps: the local ones, then the exchanged ones it owns."""
        return [p.slot for p in self.local] + self.owned

    def to_owners(self, shard: torch.Tensor, *, label: str) -> tuple[torch.Tensor, Handle]:
        """Start sending this rank's pieces of `shard` (any per-element tensor of the
        group, such as the gradient or an update) to their owners; returns the owner's
        buffer (filled once the handle is waited) and the handle."""
        send = (
            torch.cat([shard[p.start : p.start + p.numel] for p in self.pieces])
            if self.pieces
            else shard.new_empty(0)
        )
        owned = shard.new_empty(self.owned_numel)
        handle = self.group.all_to_all(owned, send, self.recv_splits, self.send_splits, label=label)
        return owned, handle

    def views(self, owned: torch.Tensor) -> list[torch.Tensor]:
        """Each owned exchanged matrix as a view of the owner's buffer, in its shape."""
        out, at = [], 0
        for s in self.owned:
            out.append(owned[at : at + s.numel].view(s.shape))
            at += s.numel
        return out

    def local_views(self, shard: torch.Tensor) -> list[torch.Tensor]:
        """Each local matrix as a view of `shard`, in its shape."""
        return [shard[p.start : p.start + p.numel].view(p.slot.shape) for p in self.local]

    def from_owners(self, owned: torch.Tensor, *, label: str) -> tuple[torch.Tensor, Handle]:
        """Start sending the owner's buffer back; returns what this rank receives (its
        pieces, in the order of `pieces`) and the handle."""
        back = owned.new_empty(sum(self.send_splits))
        handle = self.group.all_to_all(back, owned, self.send_splits, self.recv_splits, label=label)
        return back, handle

    def split_back(self, back: torch.Tensor) -> list[tuple[ShardPiece, torch.Tensor]]:
        """What `from_owners` received, cut into this rank's pieces."""
        out, at = [], 0
        for p in self.pieces:
            out.append((p, back[at : at + p.numel]))
            at += p.numel
        return out


def matrix_exchanges(
    groups: Sequence[FlatParamGroup], owners: Mapping[str, MatrixOwners]
) -> dict[int, MatrixExchange]:
    """Each trainable group of `groups` (by index): its exchange with the owners
    (`owners`, by process-group label)."""
    return {
        g.index: MatrixExchange(g.layout, owners[g.key.process_group].owner, g.process_group)
        for g in groups
        if g.trainable
    }


class ExchangingStep(AfterBackward):
    """What the whole-matrix steppers share: their optimizer (whose first param group is
    the combined optimizer's `offset`-th), its trainable flat groups and each one's
    exchange with the owners (`exchanges`, by group index: `matrix_exchanges`); under
    tensor parallelism its tp dim (`tensor_parallel`)."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        groups: Sequence[FlatParamGroup],
        exchanges: Mapping[int, MatrixExchange],
        offset: int,
        tensor_parallel: TensorParallel | None = None,
    ) -> None:
        self.why = WHOLE_STEP_IS_COLLECTIVE
        self.optimizer = optimizer
        self.offset = offset
        self.tensor_parallel = tensor_parallel
        self.groups = [g for g in groups if g.trainable]
        self.exchanges = {g.index: exchanges[g.index] for g in self.groups}


def _in_shard(layout: FlatLayout, s: Slot, rank: int) -> bool:
    """Whether slot `s` lies whole in `rank`'s shard."""
    lo, hi = layout.shard_range(rank)
    return lo <= s.offset and s.end <= hi
