"""Reading the parameters of tensor-parallel groups (`GroupMeta.tensor_split`) whole, or
cut as another run cuts them.

[Note: recutting tensor-parallel pieces]
A split slot's full tensor is its instances' pieces joined along the split dim. Read
whole (consolidation, `full_state_dict`), its flattened elements are runs of `inner`
contiguous elements (the piece's extent along the dim times everything after it), run
j coming from instance j % instances: `read_full_range` reads each run straight into the
output, so a chunk of a big tensor costs reads, not a copy of the tensor. Loaded by a
run that cuts it otherwise (another tensor-parallel size, or none), the target's piece
is the full tensor narrowed along its own dim (`read_region`): only the instances that
hold some of it are read, one slot at a time, so no rank holds more than one full
parameter beside its shards.
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
    expert: int | None = None,
) -> None:
    """Flat elements [start, start + out.numel()) of `slot`'s full tensor into `out` (1-D):
    its pieces joined when it is split, else instance 0's (see [Note: recutting
    tensor-parallel pieces]); `expert`: that expert's, from its run of instances
    (`GroupMeta.expert_split`)."""
    split = group.tensor_split if expert is None else group.expert_split
    dim = None if split is None else split.dims.get(slot.name)
    first = 0 if expert is None or split is None else expert * split.ranks
    if dim is None:
        lo = slot.offset + start
        reader.read_flat(group, kind, lo, lo + out.numel(), out, first)
        return
    assert split is not None
    parts = group.instances if expert is None else split.ranks
    inner = math.prod(slot.shape[dim:])  # one run: the piece's extent along dim, and after
    at, end = start, start + out.numel()
    while at < end:
        run, within = divmod(at, inner)
        outer, instance = divmod(run, parts)
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
    dim: int | None,
    lo: int,
    hi: int,
) -> torch.Tensor:
    """`slot`'s full tensor narrowed to [lo, hi) along `dim` (None: whole), read from the
    instances that hold some of it (see [Note: recutting tensor-parallel pieces])."""
    split = group.split_dim(slot.name)
    if split is None:
        whole = _read_piece(reader, group, kind, slot, 0)
        return whole if dim is None else whole.narrow(dim, lo, hi - lo)
    n = slot.shape[split]
    if dim == split:
        parts = []
        for k in range(lo // n, (hi - 1) // n + 1):
            a, b = max(lo, k * n), min(hi, (k + 1) * n)
            parts.append(_read_piece(reader, group, kind, slot, k).narrow(split, a - k * n, b - a))
        return torch.cat(parts, split)
    pieces = [_read_piece(reader, group, kind, slot, k) for k in range(group.instances)]
    whole = torch.cat(pieces, split)
    return whole if dim is None else whole.narrow(dim, lo, hi - lo)
