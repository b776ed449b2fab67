"""What `initialize(..., device_mesh=...)` refuses, on every rank, before it changes
anything: DTensor parameters without a mesh, a mesh of other dims (3-D ones in another
order included), combinations not supported yet (shard_group_size, the fp8 gather), a
split that does not divide, one rank without the mesh (the same error on both, no
hang)."""

from __future__ import annotations

from typing import Any

import pytest
import torch.distributed as dist
from torch import nn

import zeroshard.engine as zs
from tests._dist import run_each, run_ranks
from tests.engine import _tp
from zeroshard.engine.runtime._state import is_initialized


def _refusals() -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (1, 2), mesh_dim_names=("dp", "tp"))

    def split() -> nn.Module:
        model, _ = _tp.split_model(mesh, sp=False, seed=0)
        return model

    def refused(match: str, model: nn.Module, config: Any = None, **kwargs: Any) -> None:
        with pytest.raises(ValueError, match=match):
            zs.initialize(model, _tp.make_optimizer(model), config, **kwargs)
        assert not is_initialized(model)

    def no_mesh() -> None:
        refused(r"are DTensors .*device_mesh=mesh", split())

    def other_dims() -> None:
        odd = init_device_mesh("cpu", (1, 2), mesh_dim_names=("data", "model"))
        refused(r"device_mesh must have the dims \('dp', 'tp'\)", split(), device_mesh=odd)

    def hybrid_dims_misordered() -> None:
        names = ("dp_shard", "dp_replicate", "tp")
        cube = init_device_mesh("cpu", (1, 1, 2), mesh_dim_names=names)
        refused(r"\('dp_replicate', 'dp_shard', 'tp'\), got", split(), device_mesh=cube)

    def shard_group_size() -> None:
        config = {"stage": 2, "shard_group_size": 1}
        refused(r"cannot be combined with shard_group_size", split(), config, device_mesh=mesh)

    def uneven() -> None:
        model = nn.Sequential(nn.Linear(4, 5))
        parallelize_module(model, mesh["tp"], {"0": ColwiseParallel()})
        refused(
            r"'0.weight' of shape \(5, 4\) is split along dim 0 over tp 2", model, device_mesh=mesh
        )

    def one_rank_without_mesh() -> None:
        # The same error on both ranks, from the initialize digest, before anything else.
        given = mesh if dist.get_rank() == 0 else None
        refused(r"device_mesh", split(), device_mesh=given)

    checks = [
        no_mesh,
        other_dims,
        hybrid_dims_misordered,
        shard_group_size,
        uneven,
        one_rank_without_mesh,
    ]
    run_each([{"check": c} for c in checks], lambda check: check())


def test_tensor_parallel_refusals() -> None:
    run_ranks(_refusals, 2)
