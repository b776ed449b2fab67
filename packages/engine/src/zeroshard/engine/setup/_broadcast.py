"""`broadcast_initial_state`: every replica of a parameter or buffer starts equal.

[Note: one set of initial weights]
Ranks that build the model with different seeds, or that load pretrained weights on
rank 0 only (`if rank == 0: model.load_state_dict(...)`), hold different weights under
the same names; sharded as they are, each rank's shard would come from its own copy and
the model would be stitched from every rank's weights. So, as DDP and DeepSpeed do at
construction, `initialize` first copies every parameter and buffer from the first rank
of the ranks that hold replicas of it, before anything is flattened:

- most tensors are replicated on every rank of the group `initialize` shards over (and
  under hybrid sharding on every rank of the world: the shard groups are replicas of
  each other), so they come from its rank 0;
- a module given a process group of its own (`process_groups=`, experts) is replicated
  on that group only: its tensors come from that group's first rank, and other groups'
  ranks keep theirs (they hold other experts under the same names);
- a DTensor parameter (tensor parallelism) holds another piece on each tensor-parallel
  rank: its local tensor is replicated on the device mesh's `dp` group only and comes
  from that group's first rank (torch's `distribute_tensor` made the pieces of one
  tensor-parallel group agree); on a 3-D mesh over `dp_shard`, then over `dp_replicate`;
  a DTensor of a module on a group of its own over that group only, and a plain
  parameter of such a module over that group, then over `tp` (its group at each tp
  coordinate holds the same data-parallel indices).

Parameters still on the meta device are not sent: stage 3 materializes them unit by
unit from a generator seeded alike on every rank (`_materialize`), so they start equal.

Cost: one pass over the weights, each tensor's bytes in its own dtype sent once from the
first rank (a model's bytes: 2 bytes a parameter in bf16). They go through one staging
buffer of at most `BUCKET_BYTES` on the group's device, so no rank holds more than
that beyond its model, at stage 3 too.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import nn

from zeroshard.comm import Group
from zeroshard.engine.runtime._tensor_parallel import data_of, is_dtensor

BUCKET_BYTES = 64 * 2**20
_LABEL = "initialize: the first rank's weights to every replica"


def _replica_groups(
    model: nn.Module,
    everyone: Group,
    own: Mapping[str, Group],
    pieces: Sequence[Group],
    tp: Group | None,
) -> list[tuple[Group, list[torch.Tensor]]]:
    """The tensors to send over each group, in an order every rank shares (DTensors'
    local tensors over each of `pieces` in turn, then plain tensors of own groups over
    `tp`, last)."""
    paths = sorted(own)
    groups = [everyone, *(own[path] for path in paths)]
    where: dict[int, int] = {}
    # Shorter paths first: a module inside another's own group takes its innermost one.
    for path in sorted(own, key=lambda p: (len(p.split(".")), p)):
        index = 1 + paths.index(path)
        module = model.get_submodule(path)
        where.update({id(t): index for t in (*module.parameters(), *module.buffers())})
    tensors: list[list[torch.Tensor]] = [[] for _ in groups]
    local: list[torch.Tensor] = []
    over_tp: list[torch.Tensor] = []
    for _, t in (*model.named_parameters(), *model.named_buffers()):
        if t.is_meta:
            continue
        index = where.get(id(t), 0)
        if is_dtensor(t):
            assert pieces  # initialize refuses DTensors without a mesh
            (tensors[index] if index else local).append(data_of(t))
            continue
        tensors[index].append(t)
        if index and tp is not None:
            over_tp.append(t)
    sent = [*zip(groups, tensors, strict=True), *((g, local) for g in pieces)]
    return sent if tp is None else [*sent, (tp, over_tp)]


@torch.no_grad()
def broadcast_initial_state(
    model: nn.Module,
    everyone: Group,
    own: Mapping[str, Group],
    pieces: Sequence[Group] = (),
    tp: Group | None = None,
) -> None:
    """Copy every parameter and buffer from the first rank of its replicas, through one
    bounded buffer; DTensor parameters' local tensors over each of `pieces` in turn (the
    mesh's data-parallel groups), own groups' plain tensors over `tp` (the mesh's) last.
    See [Note: one set of initial weights]."""
    for group, tensors in _replica_groups(model, everyone, own, pieces, tp):
        if group.size > 1 and tensors:
            _broadcast(group, tensors)


def _broadcast(group: Group, tensors: Sequence[torch.Tensor]) -> None:
    """Send `tensors`' bytes from the group's rank 0, a bucket at a time."""
    total = sum(t.numel() * t.element_size() for t in tensors)
    if total == 0:
        return
    bucket = torch.empty(min(total, BUCKET_BYTES), dtype=torch.uint8, device=group.device)
    sender = group.rank == 0
    pieces: list[tuple[torch.Tensor, int, int, int]] = []  # (bytes, start, count, at)
    rewrite: list[tuple[torch.Tensor, torch.Tensor]] = []  # (tensor, its contiguous copy)
    filled = 0

    def flush() -> None:
        nonlocal filled
        group.broadcast(bucket[:filled], 0, label=_LABEL).wait()
        if not sender:
            for raw, start, count, at in pieces:
                raw[start : start + count].copy_(bucket[at : at + count])
        pieces.clear()
        filled = 0

    for t in tensors:
        data = t.detach()
        work = data if data.is_contiguous() else data.contiguous()
        if work is not data:
            rewrite.append((data, work))
        raw = work.view(-1).view(torch.uint8)
        start = 0
        while start < raw.numel():
            count = min(raw.numel() - start, bucket.numel() - filled)
            if sender:
                bucket[filled : filled + count].copy_(raw[start : start + count])
            pieces.append((raw, start, count, filled))
            filled += count
            start += count
            if filled == bucket.numel():
                flush()
    if filled:
        flush()
    if not sender:
        for data, work in rewrite:
            data.copy_(work)
