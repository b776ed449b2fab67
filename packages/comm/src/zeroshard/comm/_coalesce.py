"""Coalesced collectives: many tensors of mixed sizes moved as few bucketed collectives.

All-gather: each bucket's local tensors are packed with one fused op (`torch.cat`, casting
on the way so only the target dtype's bytes travel) straight into this rank's row of the
receive buffer, and the gather runs in place: no send buffer, and NCCL skips copying the
local part. Reduce-scatter: `torch._chunk_cat` pads and interleaves every tensor's rank
parts in one kernel. One collective per bucket; the results are views of the received
buffer: no per-tensor collective and no unpacking copy.

Pipelining: buckets are packed and issued in order on the current stream; the pack of
bucket b+1 (or of the next call, when the caller issues it before waiting this one) runs
while the collective of bucket b runs on the communication stream (see [Note: streams
and memory] in `_group.py`). The communication stream competes with the packs for SMs:
a process group whose NCCL stream has high priority (``pg_options`` with
``ProcessGroupNCCL.Options.is_high_priority_stream``) keeps the packs from delaying it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from zeroshard.comm._group import Group, Handle, ReduceOp

DEFAULT_BUCKET_BYTES = 64 * 1024 * 1024

# torch >= 2.4 has the fused pad-and-interleave op FSDP2 uses for reduce-scatter input.
_chunk_cat = getattr(torch, "_chunk_cat", None)


def _buckets(numels: Sequence[int], itemsize: int, bucket_bytes: int) -> list[range]:
    """Consecutive index ranges packing to at most `bucket_bytes` (a lone tensor may exceed it).

    Empty tensors join the open bucket rather than start one.
    """
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    out: list[range] = []
    start, size = 0, 0
    for i, n in enumerate(numels):
        if n and i > start and (size + n) * itemsize > bucket_bytes:
            out.append(range(start, i))
            start, size = i, 0
        size += n
    if start < len(numels):
        out.append(range(start, len(numels)))
    return out


def _check_inputs(name: str, tensors: Sequence[torch.Tensor], dtype: torch.dtype | None) -> None:
    if dtype is not None and not (dtype.is_floating_point or dtype.is_complex):
        raise ValueError(f"{name}: dtype must be a floating point type, got {dtype}")
    device = tensors[0].device
    if any(t.device != device for t in tensors):
        raise ValueError(f"{name}: all tensors must be on one device ({device} first)")


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
    each local tensor before it travels (the downcast-before-gather). A bucket holding
    one contiguous tensor already of `dtype` is sent without a copy: as for every
    collective, do not write the inputs before the handles are waited. Other buckets are
    packed into this rank's row of the received buffer and gathered in place.
    """
    if not tensors:
        return [], []
    _check_inputs("all_gather_coalesced", tensors, dtype)
    dtype = dtype or tensors[0].dtype
    device = tensors[0].device
    world = group.size
    numels = [t.numel() for t in tensors]
    outs: list[torch.Tensor] = []
    handles: list[Handle] = []
    rank = group.rank
    for b, idx in enumerate(_buckets(numels, dtype.itemsize, bucket_bytes)):
        sizes = [numels[i] for i in idx]
        total = sum(sizes)
        recv = torch.empty(world, total, dtype=dtype, device=device)
        outs.extend(recv.split_with_sizes(sizes, dim=1))
        if total == 0:
            continue  # every rank has the same sizes, so every rank skips this bucket
        first = tensors[idx[0]]
        if len(idx) == 1 and first.dtype == dtype and first.is_contiguous():
            send = first.view(-1)
        else:
            # In place: this rank's row of `recv` is the collective's input.
            send = recv[rank]
            _pack_gather_input([tensors[i] for i in idx], send)
        handles.append(group.all_gather_into(recv.view(-1), send, label=f"{label}[bucket {b}]"))
    return outs, handles


def _pack_gather_input(tensors: Sequence[torch.Tensor], send: torch.Tensor) -> None:
    """Write the tensors end to end into `send`, cast to its dtype, in one fused op."""
    torch.cat([t.reshape(-1) for t in tensors], out=send)


def _pack_reduce_input(
    flats: Sequence[torch.Tensor], parts: Sequence[int], world: int, send: torch.Tensor
) -> None:
    """Write `send` (world x sum(parts)): row r holds part r of every tensor, zero-padded."""
    nonempty = [f for f in flats if f.numel()]
    if _chunk_cat is not None and nonempty and all(f.dtype == nonempty[0].dtype for f in nonempty):
        # One fused kernel on CUDA (same dtype, or bf16 -> fp32); torch pads with zeros.
        _chunk_cat(nonempty, dim=0, num_chunks=world, out=send)
        return
    # Fallback (old torch, or inputs of mixed dtypes): zero the bucket so padding tails add
    # nothing to other ranks' sums, then one fused copy of every tensor's whole rows.
    send.zero_()
    dests: list[torch.Tensor] = []
    srcs: list[torch.Tensor] = []
    cols = send.split_with_sizes(list(parts), dim=1)
    for col, flat, part in zip(cols, flats, parts, strict=True):
        full, rest = divmod(flat.numel(), part) if part else (0, 0)
        if full:
            dests.append(col[:full])
            srcs.append(flat[: full * part].view(full, part))
        if rest:
            dests.append(col[full, :rest])
            srcs.append(flat[full * part :])
    if dests:
        torch._foreach_copy_(dests, srcs)


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
    ceil(numel / size)). `dtype` is the dtype the reduction runs in. A bucket holding one
    contiguous tensor of `dtype` whose size divides evenly is sent without a copy.
    """
    if not tensors:
        return [], []
    _check_inputs("reduce_scatter_coalesced", tensors, dtype)
    world = group.size
    dtype = dtype or tensors[0].dtype
    device = tensors[0].device
    numels = [t.numel() for t in tensors]
    parts = [-(-n // world) for n in numels]
    outs: list[torch.Tensor] = []
    handles: list[Handle] = []
    for b, idx in enumerate(_buckets([p * world for p in parts], dtype.itemsize, bucket_bytes)):
        sizes = [parts[i] for i in idx]
        total = sum(sizes)
        recv = torch.empty(total, dtype=dtype, device=device)
        outs.extend(recv.split_with_sizes(sizes))
        if total == 0:
            continue
        first = tensors[idx[0]]
        if (
            len(idx) == 1
            and first.dtype == dtype
            and first.is_contiguous()
            and numels[idx[0]] == total * world
        ):
            send = first.view(-1)
        else:
            send = torch.empty(world, total, dtype=dtype, device=device)
            _pack_reduce_input([tensors[i].reshape(-1) for i in idx], sizes, world, send)
        handles.append(
            group.reduce_scatter(recv, send.view(-1), op=op, label=f"{label}[bucket {b}]")
        )
    return outs, handles


def wait_all(handles: Sequence[Handle]) -> None:
    """Wait on every handle in order."""
    for h in handles:
        h.wait()
