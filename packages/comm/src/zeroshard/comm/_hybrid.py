"""Hybrid (replicate x shard) subgroups of the world group."""

from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch.distributed as dist

from zeroshard.comm._group import DEFAULT_TIMEOUT, Group


@dataclass(frozen=True)
class HybridGroups:
    """This rank's two subgroups: `shard` (ranks that split the state) and `replicate`
    (ranks that hold the same shard, across shard groups)."""

    shard: Group
    replicate: Group


def make_hybrid_groups(
    replicate: int,
    shard: int,
    *,
    timeout: datetime.timedelta = DEFAULT_TIMEOUT,
    blocking_wait: bool = False,
) -> HybridGroups:
    """Split the world into `replicate` groups of `shard` consecutive ranks.

    World ranks r*shard .. r*shard+shard-1 form shard group r; ranks with the same
    position in their shard group form a replicate group. Every rank must call this
    with the same shape (subgroup creation is itself collective). `timeout` is both the
    subgroups' own (torch) timeout and their `Group.timeout`.
    """
    world = dist.get_world_size()
    if replicate < 1 or shard < 1 or replicate * shard != world:
        raise ValueError(
            f"hybrid shape (replicate={replicate}, shard={shard}) does not cover "
            f"the world of {world} ranks"
        )
    rank = dist.get_rank()
    mine_shard: dist.ProcessGroup | None = None
    mine_repl: dist.ProcessGroup | None = None
    # Every rank creates every subgroup in the same order, as torch requires.
    for r in range(replicate):
        ranks = list(range(r * shard, (r + 1) * shard))
        pg = dist.new_group(ranks, timeout=timeout)
        if rank in ranks:
            mine_shard = pg
    for s in range(shard):
        ranks = list(range(s, world, shard))
        pg = dist.new_group(ranks, timeout=timeout)
        if rank in ranks:
            mine_repl = pg
    assert mine_shard is not None and mine_repl is not None
    return HybridGroups(
        Group(mine_shard, timeout, blocking_wait), Group(mine_repl, timeout, blocking_wait)
    )
