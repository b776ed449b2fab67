"""Coalesced all-gather / reduce-scatter: mixed sizes, casts, bucket splitting, views."""

from __future__ import annotations

from functools import partial
from typing import cast

import pytest
import torch

from tests._dist import run_each, run_ranks, subtests, world_fits
from tests.comm._data import (
    assert_matches,
    groups_by_size,
    rank_data,
    rank_device,
    ranks_for,
    reduce_reference,
)
from zeroshard.comm import (
    Group,
    ReduceOp,
    all_gather_coalesced,
    reduce_scatter_coalesced,
    wait_all,
)

# Mixed sizes: a matrix, odd vectors, a scalar-like 1, a big one, an empty one. Numels
# 15, 7, 1, 20, 192, 0, 26; the (3, 5) one is stored transposed (not contiguous).
SHAPES = [(3, 5), (7,), (1,), (4, 5), (12, 16), (0,), (26,)]
BIG = 1 << 30


def _inputs(rank: int, seed: int, dtypes: list[torch.dtype]) -> list[torch.Tensor]:
    """Rank `rank`'s tensors on CPU; tensor i has dtype dtypes[i % len(dtypes)]."""
    out = []
    for i, shape in enumerate(SHAPES):
        numel = 1
        for s in shape:
            numel *= s
        out.append(rank_data(rank, seed * 16 + i, numel, dtypes[i % len(dtypes)]).view(shape))
    out[0] = out[0].view(5, 3).t()  # shape (3, 5), strided: packing must follow reshape order
    return out


def _flat(t: torch.Tensor) -> torch.Tensor:
    """A tensor's elements in logical (row-major) order, whatever its strides."""
    return t.reshape(-1)


def _bucket_storages(outs: list[torch.Tensor]) -> list[int]:
    """Distinct storages behind non-empty outputs, in order of first appearance."""
    seen: list[int] = []
    for o in outs:
        if o.numel():
            ptr = o.untyped_storage().data_ptr()
            if ptr not in seen:
                seen.append(ptr)
    return seen


# Expected bucket counts, worked out by hand (see the comments) for the numels above.
# all-gather buckets by the bytes that travel, so the target dtype decides:
#   fp32, 100 B = 25 elements: [15 7 1] [20] [192 0] [26] -> 4
#   bf16, 100 B = 50 elements: [15 7 1 20] [192 0] [26] -> 3
#   1 B: every non-empty tensor alone, the empty one rides along -> 6; 1 GiB: 1.
AG_BUCKETS = {(torch.float32, 100): 4, (torch.bfloat16, 100): 3}


def _gather_case(
    group: Group, src_dtypes: str, dtype: str | None, bucket_bytes: int, seed: int
) -> None:
    dev = rank_device()
    world, me = group.size, group.rank
    dts = [getattr(torch, d) for d in src_dtypes.split("+")]
    target = getattr(torch, dtype) if dtype else dts[0]
    tensors = [t.to(dev) for t in _inputs(me, seed, dts)]
    outs, handles = all_gather_coalesced(
        group, tensors, dtype=target, bucket_bytes=bucket_bytes, label="unit"
    )
    expected_buckets = {1: 6, BIG: 1}.get(bucket_bytes) or AG_BUCKETS[(target, bucket_bytes)]
    assert len(handles) == expected_buckets, (len(handles), expected_buckets)
    assert len(_bucket_storages(outs)) == expected_buckets, "outputs are not views of buckets"
    assert all(h.label.startswith("unit[bucket ") for h in handles)
    wait_all(handles)
    refs = [_inputs(r, seed, dts) for r in range(world)]
    for i, out in enumerate(outs):
        assert out.shape == (world, tensors[i].numel()) and out.dtype == target
        for r in range(world):
            # Cast on the sender, before the gather: exactly the local cast's bits.
            assert torch.equal(out[r].cpu(), _flat(refs[r][i]).to(target)), (i, r)


def _reduce_case(
    group: Group, op: str, src_dtypes: str, dtype: str | None, bucket_bytes: int, seed: int
) -> None:
    dev = rank_device()
    world, me = group.size, group.rank
    dts = [getattr(torch, d) for d in src_dtypes.split("+")]
    target = getattr(torch, dtype) if dtype else dts[0]
    tensors = [t.to(dev) for t in _inputs(me, seed, dts)]
    reduce_op = cast(ReduceOp, op)
    outs, handles = reduce_scatter_coalesced(
        group, tensors, op=reduce_op, dtype=target, bucket_bytes=bucket_bytes, label="grads"
    )
    if bucket_bytes == 1:
        assert len(handles) == 6  # every non-empty tensor alone
    elif bucket_bytes == BIG:
        assert len(handles) == 1
    elif world == 2 and target == torch.float32:
        # parts 8 4 1 10 96 0 13, padded x2 = 16 8 2 20 192 0 26; 25 elements per bucket:
        # [16 8] [2 20] [192 0] [26]
        assert len(handles) == 4
    assert len(_bucket_storages(outs)) == len(handles)
    wait_all(handles)
    refs = [_inputs(r, seed, dts) for r in range(world)]
    for i, out in enumerate(outs):
        numel = tensors[i].numel()
        part = -(-numel // world)
        assert out.shape == (part,)
        # Pad each rank's tensor with zeros, cast to the reduce dtype, reduce, take my part.
        padded = [
            torch.cat([_flat(refs[r][i]).to(target), torch.zeros(part * world - numel)])
            for r in range(world)
        ]
        expected = reduce_reference(padded, op)[me * part : (me + 1) * part]
        assert_matches(out, expected, target)
    for t, ref in zip(tensors, _inputs(me, seed, dts), strict=True):
        assert torch.equal(t.cpu(), ref), "an input was modified"


def _lone_tensor_case(group: Group, seed: int) -> None:
    # A bucket of one tensor of the right dtype travels without a pack copy.
    dev = rank_device()
    world, me = group.size, group.rank
    t = rank_data(me, seed, 8 * world, torch.float32).to(dev)
    (out,), handles = all_gather_coalesced(group, [t])
    wait_all(handles)
    for r in range(world):
        assert torch.equal(out[r].cpu(), rank_data(r, seed, 8 * world, torch.float32))
    (part,), handles = reduce_scatter_coalesced(group, [t], op="sum")
    wait_all(handles)
    inputs = [rank_data(r, seed, 8 * world, torch.float32) for r in range(world)]
    assert_matches(part, reduce_reference(inputs, "sum")[me * 8 : (me + 1) * 8], torch.float32)


def _bad_inputs(group: Group) -> None:
    dev = rank_device()
    x = [torch.zeros(3, device=dev)]
    assert all_gather_coalesced(group, []) == ([], [])
    with pytest.raises(ValueError, match="bucket_bytes must be positive"):
        all_gather_coalesced(group, x, bucket_bytes=0)
    with pytest.raises(ValueError, match="floating point"):
        reduce_scatter_coalesced(group, x, dtype=torch.int32)
    with pytest.raises(ValueError, match="one device"):
        all_gather_coalesced(group, [*x, torch.zeros(3, device="meta")])


def _body() -> None:
    buckets = [1, 100, BIG]
    gather = subtests(
        {
            "src_dtypes": ["float32", "bfloat16", "float32+bfloat16"],
            "dtype": [None, "bfloat16"],
            "bucket_bytes": buckets,
        }
    )
    # fp32 -> fp32 and bf16 -> bf16 only from single-dtype lists (the target is the first's).
    gather = [c for c in gather if not (c["dtype"] is None and "+" in c["src_dtypes"])]
    reduce = subtests(
        {
            "op": ["sum", "avg", "max"],
            "src_dtypes": ["float32", "bfloat16", "bfloat16+float32"],
            "dtype": [None, "float32", "bfloat16"],
            "bucket_bytes": buckets,
        }
    )
    reduce = [c for c in reduce if not (c["dtype"] is None and "+" in c["src_dtypes"])]
    # Sizes in turn; ranks outside a smaller group wait for it at the final barrier.
    for _, group in sorted(groups_by_size().items()):
        if group is None:
            continue
        _bad_inputs(group)
        run_each([dict(c, seed=i) for i, c in enumerate(gather)], partial(_gather_case, group))
        run_each(
            [dict(c, seed=100 + i) for i, c in enumerate(reduce)], partial(_reduce_case, group)
        )
        run_each([{"seed": 7}], partial(_lone_tensor_case, group))
    Group().barrier(label="end")


@pytest.mark.gpu
def test_coalesced_collectives(device: str) -> None:
    """Mixed sizes and dtypes, downcast before gather, 1 / several / per-tensor buckets,
    on groups of 1-4 ranks (subgroups of one 4-rank spawn; on GPUs, up to 4)."""
    world = ranks_for(device)
    world_fits(device, world)
    run_ranks(_body, world, device=device)
