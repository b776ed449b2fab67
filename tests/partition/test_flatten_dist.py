"""The three flatten tiers on real ranks give bitwise identical buffers and free the originals."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tests._dist import run_each, run_ranks, subtests
from tests.partition._helpers import bitwise_equal, random_params, reference_flat
from zeroshard.comm import Group
from zeroshard.partition import FlatLayout, FlattenTier, flatten_params, flatten_shard

# Scalars and zero-size params, slots straddling shard boundaries, a slot larger than a shard.
SHAPES = [("emb", (13, 5)), ("scale", ()), ("empty", (0, 3)), ("w", (7, 3)), ("b", (7,))]
TIERS = (FlattenTier.DEVICE, FlattenTier.CPU, FlattenTier.DISTRIBUTED, FlattenTier.AUTO)


def _device() -> torch.device:
    if torch.cuda.is_available() and torch.distributed.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _case(
    groups: dict[int, Group | None],
    size: int,
    dtype: torch.dtype,
    alignment: int,
    layout_world: int,
) -> None:
    group = groups[size]
    if group is None:
        return  # this rank is outside the subgroup of this size
    device = _device()
    world = layout_world or group.size
    layout = FlatLayout.build(SHAPES, dtype, world, alignment)
    # The same seed on every rank: parameters are replicated, as after a seeded init.
    originals = random_params(layout, seed=alignment * 7 + world)
    ref = reference_flat(originals, layout)
    for tier in TIERS:
        params = [t.to(device, copy=True) for t in originals]
        refs = [int(p.untyped_storage()._weak_ref()) for p in params if p.numel()]
        if tier is FlattenTier.DISTRIBUTED and layout.padded_numel % group.size:
            # Raised before any collective, on every rank alike: no rank is left waiting.
            with pytest.raises(ValueError, match="does not split evenly"):
                flatten_params(params, layout, device=device, tier=tier, group=group)
            continue
        flat, used = flatten_params(params, layout, device=device, tier=tier, group=group)
        assert used is (FlattenTier.DEVICE if tier is FlattenTier.AUTO else tier), (tier, used)
        assert flat.device == device
        assert bitwise_equal(flat, ref), f"tier {tier} differs from the reference"
        for p, orig in zip(params, originals, strict=True):
            assert bitwise_equal(p, orig)
            if p.numel():
                assert p.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()
        assert all(torch.UntypedStorage._expired(r) for r in refs), f"tier {tier} kept originals"
    if layout_world == 0:
        shard = flatten_shard(originals, layout, group.rank, device=device)
        lo, hi = layout.shard_range(group.rank)
        assert bitwise_equal(shard, ref[lo:hi])


def _subgroups() -> dict[int, Group | None]:
    """Group of the first k ranks for k = 2 .. world (None where this rank is not in it)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    out: dict[int, Group | None] = {}
    for k in range(2, world + 1):
        # Every rank creates every subgroup, in the same order, as torch requires.
        pg = dist.new_group(list(range(k))) if k < world else None
        out[k] = Group(pg) if rank < k else None
    return out


def _tiers_body() -> None:
    groups = _subgroups()
    cases = subtests(
        {
            "groups": [groups],
            "size": sorted(groups),
            "dtype": [torch.float32, torch.bfloat16, torch.int64],
            "alignment": [1, 8],
            # 0: a layout for this group's size; 1: a replicated (unsharded) layout.
            "layout_world": [0, 1],
        }
    )
    run_each(cases, _case)
    if _device().type == "cuda":
        _memory_bounds()  # on the whole world


def _memory_bounds() -> None:
    """Device memory peaks per tier, against what each tier promises (CUDA only)."""
    group = Group()
    device = _device()
    # 2 MiB params: whole caching-allocator blocks, so the figures are exact.
    shapes = [(f"p{i}", (512 * 1024,)) for i in range(8)]
    layout = FlatLayout.build(shapes, torch.float32, group.size)
    full = layout.padded_numel * 4
    orig = layout.numel * 4
    shard = full // group.size
    slack = 64 * 1024
    for tier in (FlattenTier.DEVICE, FlattenTier.CPU, FlattenTier.DISTRIBUTED):
        params = [torch.ones(s, device=device) for _, s in shapes]
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        flat, _ = flatten_params(params, layout, device=device, tier=tier, group=group)
        torch.cuda.synchronize()
        extra = torch.cuda.max_memory_allocated() - before
        if tier is FlattenTier.DEVICE:
            assert extra >= full, (tier, extra)
        elif tier is FlattenTier.CPU:
            assert extra <= full - orig + slack, (tier, extra)
        else:
            assert extra <= shard + (full - orig) + slack, (tier, extra, shard)
        del flat, params


@pytest.mark.gpu
def test_tiers_are_bitwise_identical(device: str) -> None:
    # One spawn covers groups of 2 and 3 ranks (subgroups of a world of 3); a 2-GPU
    # machine covers 2.
    world = 3 if device == "cpu" else min(3, torch.cuda.device_count())
    if world < 2:
        pytest.skip("needs 2 GPUs")
    run_ranks(_tiers_body, world, device=device)
