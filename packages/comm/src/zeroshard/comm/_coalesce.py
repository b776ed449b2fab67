"""Coalesced collectives: many tensors of mixed sizes moved as few bucketed collectives.

Pack with one fused copy per bucket (`torch._foreach_copy_` into views of a preallocated
buffer, casting on the way so only the target dtype's bytes travel), one collective per
bucket, and hand back views of the received buffer: no per-tensor collective and no
unpacking copy.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from zeroshard.comm._group import Group, Handle, ReduceOp

DEFAULT_BUCKET_BYTES = 64 * 1024 * 1024


def _buckets(numels: Sequence[int], itemsize: int, bucket_bytes: int) -> list[range]:
    """Consecutive index ranges packing to at most `bucket_bytes` (a lone tensor may exceed it)."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    out: list[range] = []
    start, size = 0, 0
    for i, n in enumerate(numels):
        if i > start and (size + n) * itemsize > bucket_bytes:
            out.append(range(start, i))
            start, size = i, 0
        size += n
    if start < len(numels):
        out.append(range(start, len(numels)))
    return out


def all_gather_coalesced(
    group: Group,
    tensors: Sequence[torch.Tensor],
    *,
    dtype: torch.dtype | None = None,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    label: str = "",
) -> tuple[list[torch.Tensor], list[Handle]]:
    """Gather each rank's `tensors` (same sizes on every rank) in bucketed collectives.

    Returns, per input tensor, a `(group.size, numel)` view of the received buffer (row r
    is rank r's tensor), and the handles to wait on before reading them. `dtype` casts
    each local tensor before it travels (the downcast-before-gather).
    """
    if not tensors:
        return [], []
    dtype = dtype or tensors[0].dtype
    numels = [t.numel() for t in tensors]
    outs: list[torch.Tensor] = []
    handles: list[Handle] = []
    for b, idx in enumerate(_buckets(numels, dtype.itemsize, bucket_bytes)):
        sizes = [numels[i] for i in idx]
        total = sum(sizes)
        send = torch.empty(total, dtype=dtype, device=tensors[idx[0]].device)
        torch._foreach_copy_(
            list(send.split_with_sizes(sizes)), [tensors[i].reshape(-1) for i in idx]
        )
        recv = torch.empty(group.size * total, dtype=dtype, device=send.device)
        handles.append(group.all_gather_into(recv, send, label=f"{label}[bucket {b}]"))
        outs.extend(recv.view(group.size, total).split_with_sizes(sizes, dim=1))
    return outs, handles


def reduce_scatter_coalesced(
    group: Group,
    tensors: Sequence[torch.Tensor],
    *,
    op: ReduceOp = "avg",
    dtype: torch.dtype | None = None,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    label: str = "",
) -> tuple[list[torch.Tensor], list[Handle]]:
    """Reduce each tensor over ranks and keep this rank's even part of it, bucketed.

    Tensor i is zero-padded to a multiple of the group size and split into `size` equal
    parts; this rank receives part `rank` of the reduced tensor (a flat view of length
    ceil(numel / size)). `dtype` is the dtype the reduction runs in.
    """
    if not tensors:
        return [], []
    world = group.size
    dtype = dtype or tensors[0].dtype
    parts = [-(-t.numel() // world) for t in tensors]
    outs: list[torch.Tensor] = []
    handles: list[Handle] = []
    for b, idx in enumerate(_buckets([p * world for p in parts], dtype.itemsize, bucket_bytes)):
        sizes = [parts[i] for i in idx]
        total = sum(sizes)
        device = tensors[idx[0]].device
        send = torch.empty(world, total, dtype=dtype, device=device)
        dests: list[torch.Tensor] = []
        srcs: list[torch.Tensor] = []
        for col, i in zip(send.split_with_sizes(sizes, dim=1), idx, strict=True):
            flat = tensors[i].reshape(-1)
            pad = parts[i] * world - flat.numel()
            if pad:
                # The padding tail must be zeros: it is summed with other ranks' tails.
                flat = torch.nn.functional.pad(flat, (0, pad))
            dests.append(col)
            srcs.append(flat.view(world, parts[i]))
        torch._foreach_copy_(dests, srcs)
        recv = torch.empty(total, dtype=dtype, device=device)
        handles.append(
            group.reduce_scatter(recv, send.view(-1), op=op, label=f"{label}[bucket {b}]")
        )
        outs.extend(recv.split_with_sizes(sizes))
    return outs, handles


def wait_all(handles: Sequence[Handle]) -> None:
    """Wait on every handle in order."""
    for h in handles:
        h.wait()
