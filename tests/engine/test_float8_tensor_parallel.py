"""The fp8 gather (`enable_fsdp_float8_all_gather`) under tensor parallelism, at dp 2 x tp 2
on 4 gloo ranks, as torchtitan trains fp8 with TP: torchao's `Float8ColwiseParallel` on
the first block's `up`, `Float8RowwiseParallel` on its `down` (fp8 weights split over
tp); the second block's fp8 weights left whole on every tp rank (replicated over tp).

The reference is torch's own: the same plan on a model converted without the option (each
`Float8Linear` casts its DTensor weight, scaled by the whole weight's amax: torch's max
over the DTensor is one over tp), under torch DDP over the `dp` dim
(`_pre_dp_module_transform`), fed the same micro-batches (torchao scales activations per
rank, so a single process on the global batch is not the reference). fp32 compute,
accumulation 2, unclipped (torch's clip over DDP's local pieces is not the whole norm;
zeroshard's clip under tp is test_tensor_parallel's). A split weight's scale is the
whole weight's: scaling a tp piece by its own amax fails the losses. Tolerances are
test_float8.py's (rtol 1e-5 on the losses, atol 2e-4 on the weights: both cast the same
values with the same scales, the gradients summed in another order). A checkpoint saved
after two steps, loaded by a fresh engine, trains the third step bit for bit.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

import zeroshard.engine as zs
from tests._dist import run_ranks
from tests.engine._float8 import batches, loss_of, make_net, make_optimizer

STEPS, ACCUM = 3, 2
CONFIG = {"stage": 3, "min_unit_params": 1, "persistence_threshold": 0, "compute_dtype": "fp32"}


def _split_net(mesh: Any, gather: bool) -> nn.Module:
    """test_float8's `Net` (the same seed on every rank) parallelized over `mesh['tp']`."""
    from torch.distributed.tensor.parallel import parallelize_module
    from torchao.float8.float8_tensor_parallel import (
        Float8ColwiseParallel,
        Float8RowwiseParallel,
    )

    net = make_net(1, "tensorwise", gather, "cpu")
    plan = {"blocks.0.up": Float8ColwiseParallel(), "blocks.0.down": Float8RowwiseParallel()}
    parallelize_module(net, mesh["tp"], plan)
    return net


def _train(
    model: nn.Module, opt: torch.optim.Optimizer, data: torch.Tensor, steps: range, dp_rank: int
) -> list[float]:
    """This data-parallel rank's micro-batches of each step: the global mean losses."""
    losses = []
    for step in steps:
        total = torch.zeros(1)
        for micro in data[step]:
            loss = loss_of(model, micro[dp_rank]) / ACCUM
            loss.backward()
            total += loss.detach()
        opt.step()
        opt.zero_grad()
        dist.all_reduce(total)
        losses.append(float(total) / dist.get_world_size())
    return losses


def _reference(mesh: Any, data: torch.Tensor) -> tuple[list[float], dict[str, torch.Tensor]]:
    """torch TP + torchao (no fp8 gather) under torch DDP over dp."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel.ddp import (
        _pre_dp_module_transform,
        _reconstruct_dtensor,
    )

    net = _split_net(mesh, gather=False)
    names = [name for name, _ in net.named_parameters()]
    _pre_dp_module_transform(net)
    ddp = nn.parallel.DistributedDataParallel(net, process_group=mesh["dp"].get_group())
    losses = _train(ddp, make_optimizer(net), data, range(STEPS), mesh.get_local_rank("dp"))
    # DDP's local pieces made DTensors again (attributes, no longer registered parameters).
    _reconstruct_dtensor(net, None)
    state = {}
    for name in names:
        module, _, leaf = name.rpartition(".")
        value = getattr(net.get_submodule(module), leaf)
        state[name] = (value.full_tensor() if isinstance(value, DTensor) else value).detach()
    return losses, state


def _case(root: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    data = batches(STEPS, ACCUM, 2)
    dp_rank = mesh.get_local_rank("dp")
    ref_losses, ref_state = _reference(mesh, data)

    def build() -> tuple[nn.Module, zs.ZeroOptimizer]:
        net = _split_net(mesh, gather=True)
        return zs.initialize(net, make_optimizer(net), CONFIG, device_mesh=mesh)

    model, opt = build()
    # Every fp8 weight gathers in fp8: those split over tp, and those replicated there.
    fp8 = [g for g in zs.engine_state(model).groups if zs.float8_wire(g) is not None]
    assert sum(len(g.params) for g in fp8) == 4
    assert {g.key.process_group for g in fp8} == {"tensor-parallel", "default"}
    losses = _train(model, opt, data, range(2), dp_rank)
    zs.save_checkpoint(model, opt, Path(root), step=2, overwrite=True)
    losses += _train(model, opt, data, range(2, STEPS), dp_rank)
    torch.testing.assert_close(losses, ref_losses, rtol=1e-5, atol=0)
    full = zs.full_state_dict(model)
    assert full.keys() == ref_state.keys()
    for name, ref in ref_state.items():
        torch.testing.assert_close(
            full[name], ref, rtol=0, atol=2e-4, msg=lambda m, name=name: f"{name}: {m}"
        )

    # Resumed: a fresh engine loads the checkpoint of step 2 and trains the third alike.
    again, opt2 = build()
    assert zs.load_checkpoint(again, opt2, Path(root)) == 2
    _train(again, opt2, data, range(2, STEPS), dp_rank)
    got = zs.full_state_dict(again)
    for k, v in full.items():
        assert torch.equal(got[k], v), f"{k}: the resume is not bit-identical"


def test_float8_gather_tensor_parallel(tmp_path: Path) -> None:
    pytest.importorskip("torchao")
    run_ranks(_case, 4, str(tmp_path))
