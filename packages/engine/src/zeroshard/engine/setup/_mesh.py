"""`initialize(..., device_mesh=mesh)`: the data- and tensor-parallel groups of a 2-D or
3-D mesh, and the checks on a model that torch's tensor parallelism split over its `tp` dim.

The mesh's dims are named `dp` and `tp` (torchtitan's `init_device_mesh(..., ("dp",
"tp"))`), or `dp_replicate`, `dp_shard` and `tp` for hybrid sharding (torchtitan's HSDP
x TP), in the default layout of `init_device_mesh` (the tp ranks of one data-parallel
rank are consecutive: the checkpoint numbers its pieces by tensor-parallel rank in that
order). Every flat group is sharded over `dp` (`dp_shard`) and its gradients reduced
over it; with `dp_replicate` they are then averaged over the replicas, each of which
holds the same shards, as `shard_group_size` does without a mesh (one replica, the
ranks of one `dp_replicate` index, is the shard group: the clip norm sums over it and
its ranks alone write checkpoints). The tensor-parallel collectives of forward and
backward are torch's (see [Note: DTensor parameters] in runtime/_tensor_parallel.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from zeroshard.comm import Group, make_hybrid_groups
from zeroshard.engine.config._config import ZeroConfig
from zeroshard.engine.runtime._tensor_parallel import TensorParallel, is_dtensor, placement_problem

MESH_DIMS = ("dp", "tp")
HYBRID_DIMS = ("dp_replicate", "dp_shard", "tp")


@dataclass(frozen=True)
class MeshGroups:
    """What `initialize` takes from a device mesh: the group every flat group is sharded
    and reduced over (`data_parallel`), the tensor-parallel dim, and under hybrid
    sharding the ranks of this rank's replica (`shard`) and the replicas (`replicate`)."""

    data_parallel: Group
    tensor_parallel: TensorParallel
    shard: Group
    replicate: Group | None = None

    @property
    def pieces(self) -> tuple[Group, ...]:
        """The groups that, in turn, hold the same tensor-parallel pieces: a DTensor's local
        tensor is replicated over `data_parallel`, then over the replicas."""
        if self.replicate is None:
            return (self.data_parallel,)
        return (self.data_parallel, self.replicate)


def mesh_groups(mesh: DeviceMesh, everyone: Group, timeout: timedelta) -> MeshGroups:
    """The groups of a ("dp", "tp") or ("dp_replicate", "dp_shard", "tp") mesh over every
    rank of the job; ValueError naming what is wrong with another mesh."""
    names = mesh.mesh_dim_names
    if names not in (MESH_DIMS, HYBRID_DIMS):
        raise ValueError(
            f"device_mesh must have the dims ('dp', 'tp') or ('dp_replicate', 'dp_shard', "
            f"'tp'), got {names}: build it with init_device_mesh(device, (dp, tp), "
            "mesh_dim_names=('dp', 'tp'))"
        )
    if mesh.size() != everyone.size:
        raise ValueError(
            f"device_mesh spans {mesh.size()} ranks, the job has {everyone.size}: the mesh "
            "must cover every rank"
        )
    if mesh.device_type != everyone.device.type:
        raise ValueError(
            f"device_mesh is on {mesh.device_type!r}, the process group works on "
            f"{everyone.device.type!r}"
        )
    expected = torch.arange(everyone.size).view(mesh.shape)
    if not torch.equal(mesh.mesh.cpu(), expected):
        raise ValueError(
            f"device_mesh lays its ranks out as {mesh.mesh.tolist()}; zeroshard needs "
            f"init_device_mesh's layout {expected.tolist()} (consecutive ranks share a dp rank)"
        )
    tp = TensorParallel(mesh["tp"], Group(mesh.get_group("tp")).with_timeout(timeout))
    dp = Group(mesh.get_group("dp" if names == MESH_DIMS else "dp_shard")).with_timeout(timeout)
    replicas = 1 if names == MESH_DIMS else mesh.shape[0]
    if replicas == 1:
        return MeshGroups(dp, tp, everyone)
    # A replica's ranks are consecutive (the layout above); init_device_mesh makes no
    # group of them, the shard group that norms and checkpoints go over.
    hybrid = make_hybrid_groups(replicas, everyone.size // replicas, timeout=timeout)
    return MeshGroups(dp, tp, hybrid.shard, hybrid.replicate)


def check_mesh_inputs(
    model: nn.Module,
    cfg: ZeroConfig,
    mesh: DeviceMesh | None,
    *,
    group: Group | None,
) -> None:
    """ValueError before anything changes if `device_mesh` cannot go with the other
    inputs (or a model holds DTensor parameters without one). `process_groups` goes with
    it (checked once the mesh is known: `check_own_groups`)."""
    dtensors = [n for n, p in model.named_parameters() if is_dtensor(p)]
    if mesh is None:
        if dtensors:
            raise ValueError(
                f"parameters {dtensors[:3]}... are DTensors (tensor parallelism): pass the "
                "device mesh they were parallelized over, initialize(..., device_mesh=mesh)"
            )
        return
    taken = [
        what
        for what, given in (
            ("group", group is not None),
            ("shard_group_size", cfg.shard_group_size is not None),
        )
        if given
    ]
    if taken:
        raise ValueError(
            f"device_mesh cannot be combined with {', '.join(taken)} yet: the mesh's 'dp' "
            "dim is the group zeroshard shards over"
        )


def check_dtensor_params(model: nn.Module, tp: TensorParallel) -> None:
    """ValueError naming every DTensor parameter zeroshard cannot shard over dp (another
    mesh, an uneven split, a placement other than Shard(d) and Replicate())."""
    problems = [
        why
        for name, p in model.named_parameters()
        if is_dtensor(p) and (why := placement_problem(name, p, tp.mesh)) is not None
    ]
    if problems:
        shown = "; ".join(problems[:3]) + (
            f"; ... ({len(problems)} in all)" if len(problems) > 3 else ""
        )
        raise ValueError(shown)
