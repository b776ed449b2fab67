"""Which process group each parameter is sharded and reduced over: the world, one shard
group of hybrid sharding (`shard_group_size`), a module's own group (`process_groups`),
or a device mesh's `dp` dim."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from zeroshard.comm import Group, make_hybrid_groups
from zeroshard.engine.config._config import ZeroConfig
from zeroshard.engine.runtime._names import canonical_name
from zeroshard.engine.runtime._tensor_parallel import SPLIT_LABEL, split_dim
from zeroshard.engine.setup._mesh import MeshGroups, check_dtensor_params, mesh_groups
from zeroshard.partition import DEFAULT_GROUP_LABEL, GroupKey


@dataclass(frozen=True)
class Placement:
    """Where each parameter is sharded: `shard_group` (the world, or under hybrid sharding
    one shard group, `replicate` then averaging across them), the groups of modules that
    have their own (`own`), or with a device mesh its `dp` group (the parameters split
    over `tp` in flat groups of their own)."""

    shard_group: Group
    replicate: Group | None
    own: Mapping[str, Group]  # module path -> the data-parallel group of its parameters
    mesh: MeshGroups | None = None

    def label(self, name: str, param: nn.Parameter) -> str:
        """The longest module path of `own` that contains parameter `name`, or 'default'
        (with a mesh: whether `param` is split over tp)."""
        if self.mesh is not None:
            return SPLIT_LABEL if split_dim(param) is not None else DEFAULT_GROUP_LABEL
        best = DEFAULT_GROUP_LABEL
        for path in self.own:
            inside = name.startswith(canonical_name(path) + ".")
            if inside and (best == DEFAULT_GROUP_LABEL or len(path) > len(best)):
                best = path
        return best

    def process_group(self, key: GroupKey) -> Group:
        """The process group of a GroupKey."""
        if self.mesh is not None:
            return self.mesh.data_parallel
        return (
            self.shard_group
            if key.process_group == DEFAULT_GROUP_LABEL
            else self.own[key.process_group]
        )


def place(
    model: nn.Module,
    cfg: ZeroConfig,
    everyone: Group,
    *,
    group: Group | None,
    process_groups: Mapping[str, Group] | None,
    device_mesh: DeviceMesh | None,
    timeout: timedelta,
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
        if process_groups:
            raise ValueError(
                "process_groups and shard_group_size cannot be combined yet: the groups of "
                "their own (experts) cross the shard groups, whose first alone writes "
                "checkpoints and over which the clip norm is summed"
            )
    own = {k: g.with_timeout(timeout) for k, g in (process_groups or {}).items()}
    return Placement(shard_group, replicate, own, mesh)
