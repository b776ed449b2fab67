"""Hybrid (replicate x shard) groups and plain subgroups on real ranks."""

from __future__ import annotations

import datetime

import pytest
import torch
import torch.distributed as dist

from tests._dist import run_ranks, world_fits
from tests.comm._data import assert_matches, rank_data, rank_device, ranks_for, reduce_reference
from zeroshard.comm import Group, make_hybrid_groups


def _check_shape(replicate: int, shard: int) -> None:
    me, dev = dist.get_rank(), rank_device()
    hg = make_hybrid_groups(replicate, shard, timeout=datetime.timedelta(seconds=60))
    # Shard group r holds world ranks r*shard .. r*shard+shard-1; replicate groups stride.
    shard_members = [me // shard * shard + i for i in range(shard)]
    repl_members = list(range(me % shard, replicate * shard, shard))
    assert (hg.shard.size, hg.shard.rank) == (shard, me % shard)
    assert (hg.replicate.size, hg.replicate.rank) == (replicate, me // shard)
    assert [hg.shard.global_rank(i) for i in range(shard)] == shard_members
    assert [hg.replicate.global_rank(i) for i in range(replicate)] == repl_members
    assert hg.shard.timeout.total_seconds() == 60

    # Each group gathers exactly its members' world ranks.
    for g, members in ((hg.shard, shard_members), (hg.replicate, repl_members)):
        out = torch.empty(g.size, dtype=torch.int64, device=dev)
        g.all_gather_into(out, torch.tensor([me], device=dev)).wait()
        assert out.tolist() == members
        # Broadcast addresses the source by group rank, not world rank.
        src = g.size - 1
        t = torch.tensor([float(me)], device=dev)
        g.broadcast(t, src).wait()
        assert t.item() == members[src]

    # HSDP gradient path: reduce-scatter inside the shard group, then average the shards
    # across replicas; equals this shard's part of the global average.
    numels = [10, 3, 33]
    grads = [rank_data(me, i, n, torch.float32).to(dev) for i, n in enumerate(numels)]
    parts = []
    for g in grads:
        size = -(-g.numel() // shard)
        padded = torch.cat([g, torch.zeros(size * shard - g.numel(), device=dev)])
        part = torch.empty(size, device=dev)
        hg.shard.reduce_scatter(part, padded, op="avg").wait()
        hg.replicate.all_reduce(part, op="avg").wait()
        parts.append(part)
    world = replicate * shard
    for i, (n, p) in enumerate(zip(numels, parts, strict=True)):
        size = -(-n // shard)
        ref = reduce_reference([rank_data(r, i, n, torch.float32) for r in range(world)], "avg")
        ref = torch.cat([ref, torch.zeros(size * shard - n, dtype=ref.dtype)])
        lo = hg.shard.rank * size
        assert_matches(p, ref[lo : lo + size], torch.float32)
    # ... and the all-gather inside the shard group rebuilds the full averaged tensors.
    for i, (n, p) in enumerate(zip(numels, parts, strict=True)):
        full = torch.empty(p.numel() * shard, device=dev)
        hg.shard.all_gather_into(full, p).wait()
        ref = reduce_reference([rank_data(r, i, n, torch.float32) for r in range(world)], "avg")
        assert_matches(full[:n], ref, torch.float32)


def _subgroup() -> None:
    # A plain subgroup of the even world ranks, as Group(pg).
    me, dev = dist.get_rank(), rank_device()
    evens = list(range(0, dist.get_world_size(), 2))
    pg = dist.new_group(evens)
    if me not in evens:
        return
    g = Group(pg)
    assert g.size == len(evens) and g.rank == evens.index(me)
    t = torch.tensor([float(me + 1)], device=dev)
    g.all_reduce(t, op="sum").wait()
    assert t.item() == sum(r + 1 for r in evens)


def _body(world_size: int) -> None:
    # Every (replicate, shard) factorization: 1x4, 2x2, 4x1 on 4 ranks.
    for replicate in range(1, world_size + 1):
        if world_size % replicate == 0:
            _check_shape(replicate, world_size // replicate)
    _subgroup()
    for bad in ((world_size, 2), (0, world_size), (world_size, 0)):
        with pytest.raises(ValueError, match="does not cover the world"):
            make_hybrid_groups(*bad)
    Group().barrier()


@pytest.mark.gpu
def test_hybrid_groups(device: str) -> None:
    """2x2 / 1x4 / 4x1 on 4 ranks (1x2 / 2x1 on 2 GPUs): membership, collectives, HSDP path."""
    world = ranks_for(device)
    if world < 2:
        pytest.skip("hybrid groups need at least 2 ranks")
    world_fits(device, world)
    run_ranks(_body, world, world, device=device)
