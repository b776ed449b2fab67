"""Reading the parameters of tensor-parallel groups (`GroupMeta.tensor_split`, and each
expert of `GroupMeta.expert_split`) whole, or cut as another run cuts them.

[Note: recutting tensor-parallel pieces]
A split slot's full tensor is its instances' pieces joined along the split dim. Read
whole (consolidation, `full_state_dict`), its flattened elements are runs of `inner`
contiguous elements (the piece's extent along the dim times everything after it), run
j coming from instance j % instances (an expert's from instance j % ranks of its run:
`GroupMeta.pieces`): `read_full_range` reads each run straight into the output, so a
chunk of a big tensor costs reads, not a copy of the tensor. Loaded by a run that cuts
it otherwise (another tensor-parallel size, or none), the target's piece is the full
tensor narrowed along its own dim (`read_region`): only the instances that hold some of
it are read, one slot at a time, so no rank holds more than one full parameter beside
its shards.
"""

from __future__ import annotations

import math

import torch

from zeroshard.ckpt._group_meta import GroupMeta
from zeroshard.ckpt._reader import CheckpointReader
from zeroshard.partition import Slot


def _read_piece(
    reader: CheckpointReader, group: GroupMeta, kind: str, slot: Slot, instance: int
) -> torch.Tensor:
    """Instance `instance`'s tensor of `slot` (its piece, or the whole of a slot not split)."""
    out = torch.empty(slot.numel, dtype=group.shards[kind])
    reader.read_flat(group, kind, slot.offset, slot.end, out, instance)
    return out.view(slot.shape)


def read_full_range(
    reader: CheckpointReader,
    group: GroupMeta,
    kind: str,
    slot: Slot,
    start: int,
    out: torch.Tensor,
    expert: int = 0,
) -> None:
    """Flat elements [start, start + out.numel()) of `slot`'s full tensor into `out` (1-D):
    its pieces joined when it is split, else its instance's (see [Note: recutting
    tensor-parallel pieces]); of expert `expert` where the instances hold several
    (`GroupMeta.experts`: an expert's run of `GroupMeta.pieces` instances)."""
    dim = group.split_dim(slot.name)
    first = expert * group.pieces
    if dim is None:
        lo = slot.offset + start
        reader.read_flat(group, kind, lo, lo + out.numel(), out, first)
        return
    inner = math.prod(slot.shape[dim:])  # one run: the piece's extent along dim, and after
    at, end = start, start + out.numel()
    while at < end:
        run, within = divmod(at, inner)
        outer, instance = divmod(run, group.pieces)
        n = min(inner - within, end - at)
        lo = slot.offset + outer * inner + within
        reader.read_flat(
            group, kind, lo, lo + n, out[at - start : at - start + n], first + instance
        )
        at += n


def read_region(
    reader: CheckpointReader,
    group: GroupMeta,
    kind: str,
    slot: Slot,
    cut: tuple[int | None, int, int],
    expert: int = 0,
) -> torch.Tensor:
    """`slot`'s full tensor (expert `expert`'s, as `read_full_range`) narrowed to [lo, hi)
    along dim (`cut`; dim None: whole), read from the instances that hold some of it (see
    [Note: recutting tensor-parallel pieces])."""
    dim, lo, hi = cut
    split = group.split_dim(slot.name)
    first = expert * group.pieces
    if split is None:
        whole = _read_piece(reader, group, kind, slot, first)
        return whole if dim is None else whole.narrow(dim, lo, hi - lo)
    n = slot.shape[split]
    if dim == split:
        parts = []
        for k in range(lo // n, (hi - 1) // n + 1):
            a, b = max(lo, k * n), min(hi, (k + 1) * n)
            piece = _read_piece(reader, group, kind, slot, first + k)
            parts.append(piece.narrow(split, a - k * n, b - a))
        return torch.cat(parts, split)
    pieces = [_read_piece(reader, group, kind, slot, first + k) for k in range(group.pieces)]
    whole = torch.cat(pieces, split)
    return whole if dim is None else whole.narrow(dim, lo, hi - lo)
