"""Which process group each parameter is sharded and reduced over: the world, one shard
group of hybrid sharding (`shard_group_size`), a module's own group (`process_groups`),
or a device mesh's `dp` dim.

[Note: groups of their own beside hybrid sharding and tensor parallelism]
A module on a process group of its own (an expert) is sharded over that group and its
gradients averaged over it alone, whatever else shards the model: under hybrid sharding
its group may cross the shard groups (torchtitan's experts sharded over the ranks that
hold them, the rest over `dp_shard`), and it is never averaged over the replicas, which
hold other experts; the clip norm and fp16's overflow then sum over every rank, not one
replica (`ZeroOptimizer`'s `replicate`), and every rank writes its experts' shards to the
checkpoint, numbered over the world (`state/_checkpoint_layout.py`). Under a device mesh
an expert's own group holds data-parallel ranks of one tensor-parallel coordinate, the
same ones at every coordinate of a tensor-parallel group (`check_own_groups`):
the expert's tp pieces are then one expert, joined over tp as any split parameter.

[Note: the gradient divide factor]
A group of its own sums its ranks' gradients and divides the sum by its size: DDP over
that group, right where each rank's expert sees its own data. An expert fed by an
all-to-all sees tokens of every rank, so its local gradient already sums the world's
contributions: DeepSpeed MoE, and torchtitan through FSDP2's
`set_gradient_divide_factor`, divide it by the whole data-parallel world instead.
`initialize(..., gradient_divide_factor=f)` divides every group of its own by `f` (each
`FlatParamGroup.grad_divisor`): the reducer scales by 1/f as it copies a gradient into
its bucket (stage 1 sums, then divides the shard), `zeroshard.compile`'s reduce-scatter
divides by it, and a group of its own is never averaged over replicas, so nothing else
divides it; clipping, fp16's unscaling and an offloaded step read the divided shards.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from zeroshard.comm import Group, make_hybrid_groups
from zeroshard.engine.config._config import ZeroConfig
from zeroshard.engine.runtime._tensor_parallel import group_label, own_path, split_dim
from zeroshard.engine.setup._mesh import MeshGroups, check_dtensor_params, mesh_groups
from zeroshard.partition import GroupKey


@dataclass(frozen=True)
class Placement:
    """Where each parameter is sharded: `shard_group` (the world, or under hybrid sharding
    one shard group, `replicate` then averaging across them), the groups of modules that
    have their own (`own`), or with a device mesh its `dp` group (the parameters split
    over `tp` in flat groups of their own, an own group's too)."""

    shard_group: Group
    replicate: Group | None
    own: Mapping[str, Group]  # module path -> the data-parallel group of its parameters
    mesh: MeshGroups | None = None
    # What the own groups' summed gradients are divided by (None: each group's size):
    # [Note: the gradient divide factor].
    divide_factor: float | None = None

    def label(self, name: str, param: nn.Parameter) -> str:
        """The longest module path of `own` that contains parameter `name`, or 'default'
        (with a mesh: marked when `param` is split over tp)."""
        return group_label(name, self.mesh is not None and split_dim(param) is not None, self.own)

    def process_group(self, key: GroupKey) -> Group:
        """The process group of a GroupKey."""
        path = own_path(key.process_group)
        if path is not None:
            return self.own[path]
        return self.shard_group if self.mesh is None else self.mesh.data_parallel

    def grad_divisor(self, key: GroupKey) -> float:
        """What a GroupKey's summed gradients are divided by: its process group's size,
        or a group of its own's `divide_factor` ([Note: the gradient divide factor])."""
        if self.divide_factor is not None and own_path(key.process_group) is not None:
            return self.divide_factor
        return self.process_group(key).size

    @property
    def own_crosses_replicas(self) -> bool:
        """Whether groups of their own sit beside replicas of the shard group (hybrid
        sharding), which they may cross: see [Note: groups of their own beside hybrid
        sharding and tensor parallelism]."""
        return self.replicate is not None and bool(self.own)


def place(
    model: nn.Module,
    cfg: ZeroConfig,
    everyone: Group,
    *,
    group: Group | None,
    process_groups: Mapping[str, Group] | None,
    device_mesh: DeviceMesh | None,
    timeout: timedelta,
    gradient_divide_factor: float | None = None,
) -> Placement:
    """The placement `initialize`'s arguments ask for (collective: it makes the mesh's and
    hybrid sharding's groups)."""
    mesh = None
    if device_mesh is not None:
        mesh = mesh_groups(device_mesh, everyone, timeout)
        check_dtensor_params(model, mesh.tensor_parallel)
    shard_group, replicate = (everyone, None) if mesh is None else (mesh.shard, mesh.replicate)
    if cfg.shard_group_size is not None and cfg.shard_group_size != everyone.size:
        if group is not None:
            raise ValueError("shard_group_size works on the world group; pass no group with it")
        size = cfg.shard_group_size
        if everyone.size % size:
            raise ValueError(
                f"shard_group_size {size} does not divide the world of {everyone.size} ranks"
            )
        hybrid = make_hybrid_groups(everyone.size // size, size, timeout=timeout)
        # Everything below shards over `shard_group`; `replicate` only averages.
        shard_group, replicate = hybrid.shard, hybrid.replicate
    own = {k: g.with_timeout(timeout) for k, g in (process_groups or {}).items()}
    if own:
        check_own_groups(own, everyone, 1 if mesh is None else mesh.tensor_parallel.size)
    return Placement(shard_group, replicate, own, mesh, gradient_divide_factor)


def check_own_groups(own: Mapping[str, Group], everyone: Group, tp: int) -> None:
    """ValueError, the same on every rank, naming a group of its own that its ranks do not
    all pass (its collectives would wait for a rank that never joins them), that crosses
    tensor-parallel coordinates, or that differs from its tensor-parallel peers'
    (collective: every rank's groups are gathered). A mesh's layout puts rank r at tp
    coordinate r % tp of data-parallel index r // tp."""
    mine = {path: [g.global_rank(i) for i in range(g.size)] for path, g in sorted(own.items())}
    every: list[dict[str, list[int]] | None] = [None] * everyone.size
    dist.all_gather_object(every, mine, group=everyone.pg)
    for path in sorted(own):
        passed = {everyone.global_rank(i): sorted((e or {})[path]) for i, e in enumerate(every)}
        for r, members in passed.items():
            other = next((m for m in members if passed.get(m) != members), None)
            if other is not None:
                raise ValueError(
                    f"process_groups[{path!r}] on rank {r} holds ranks {members}, but rank "
                    f"{other} passes {passed.get(other, 'no group of this job')}: every rank "
                    "of a group must pass that group"
                )
        ranks = list(passed.items())
        if tp == 1:
            continue
        for r, members in ranks:
            if any(m % tp != r % tp for m in members):
                raise ValueError(
                    f"process_groups[{path!r}] on rank {r} holds ranks {members}, which "
                    f"cross tensor-parallel coordinates (tp {tp}: rank r is coordinate "
                    f"r % {tp}): a group of its own must hold data-parallel ranks of one "
                    "tp coordinate, whose pieces it averages (each tp rank of an expert "
                    "holds another piece of it)"
                )
            peer = dict(ranks)[r - r % tp]
            if [m // tp for m in members] != [m // tp for m in peer]:
                raise ValueError(
                    f"process_groups[{path!r}] on rank {r} holds ranks {members}, its "
                    f"tensor-parallel peer rank {r - r % tp} holds {peer}: the ranks of "
                    "one tensor-parallel group must pass groups of the same data-parallel "
                    "indices (the pieces of one expert are averaged alike)"
                )
