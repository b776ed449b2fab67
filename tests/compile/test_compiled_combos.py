"""Compiled stage 3 with fp16 loss scaling (world 2), with hybrid sharding (world 4) and
under tensor parallelism (world 2).

fp16: losses within 2e-2 of eager zeroshard fp16 and the loss scale after every step equal
to eager's; the scale doubles every step (`loss_scale_window` 1) and an overflowing step
(an inf input) is skipped on both, all with one capture: the scale is a graph input, not a
constant. Hybrid (2 shard groups of 2 ranks, gloo): losses and final parameters match the
single-process reference at rtol 1e-5 / atol 1e-6, gradients averaged over the replicas.
Tensor parallelism (dp 1 x tp 2, tests/engine/_tp.py's model, with and without sequence
parallelism): losses, clip norms and final parameters match the unsplit model trained in
one process (rtol 1e-5 / atol 1e-6), with one capture; a checkpoint saved after two steps
and loaded into a fresh compiled engine trains the third step bit for bit.
backend="aot_eager" (the graphs and passes under test, without C++ compilation).
"""

from __future__ import annotations

import copy
import math
from typing import Any

import pytest
import torch
import torch.distributed as dist

import zeroshard.compile as zc
import zeroshard.engine as zs
from tests._dist import run_each, run_ranks, world_fits
from tests.engine._models import global_batches, loss_fn, make_model, make_optimizer, reference_run

STEPS = 3
CONFIG = {"stage": 3, "min_unit_params": 1, "persistence_threshold": 0}


def _step(model: Any, opt: zs.ZeroOptimizer, tokens: torch.Tensor) -> float:
    loss = loss_fn(model, tokens)
    loss.backward()
    opt.step()
    opt.zero_grad()
    total = loss.detach().reshape(1)
    dist.all_reduce(total)
    return float(total) / dist.get_world_size()


def _fp16(device: str) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    base = make_model(seed=7).to(device)
    batches = global_batches(STEPS, 1, world, 2)
    config = {**CONFIG, "compute_dtype": "fp16", "initial_loss_scale": 2.0**8}
    config["loss_scale_window"] = 1
    runs = []
    for compiled in (False, True):
        m = copy.deepcopy(base)
        m, opt = zs.initialize(m, make_optimizer(m), config)
        runner = zc.compile(m, backend="aot_eager") if compiled else m
        losses, scales = [], []
        for step in range(STEPS):
            losses.append(_step(runner, opt, batches[step, 0, rank].to(device)))
            scales.append(opt.scaler.scale if opt.scaler else 0.0)
        # An overflow: the step is skipped (parameters unchanged), the scale halves.
        before = zs.full_state_dict(m)
        # Sliced after the move, as loss_fn slices: the input keeps the strides the graph
        # was captured with (`.to("cuda")` of a slice would copy it contiguous: a recompile).
        loss = runner(batches[0, 0, rank].to(device)[:, :-1]).float().sum() * math.inf
        loss.backward()
        opt.step()
        opt.zero_grad()
        scales.append(opt.scaler.scale if opt.scaler else 0.0)
        for name, value in zs.full_state_dict(m).items():
            torch.testing.assert_close(value, before[name], rtol=0, atol=0, msg=name)
        runs.append((losses, scales, runner))
    (eager_losses, eager_scales, _), (losses, scales, compiled_model) = runs
    assert not compiled_model.eager
    torch.testing.assert_close(losses, eager_losses, rtol=2e-2, atol=2e-2)
    assert scales == eager_scales, (scales, eager_scales)
    assert scales == [2.0**9, 2.0**10, 2.0**11, 2.0**10], scales
    assert compiled_model.compiles == 1


@pytest.mark.gpu
def test_compiled_fp16_loss_scaling(device: str) -> None:
    world_fits(device, 2)
    run_ranks(_fp16, 2, device, device=device)


def _hybrid(device: str) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    base = make_model(seed=9).to(device)
    batches = global_batches(STEPS, 1, world, 2)
    ref_losses, _, ref_state = reference_run(base.cpu(), make_optimizer, batches, None)
    model = copy.deepcopy(base).to(device)
    model, opt = zs.initialize(model, make_optimizer(model), {**CONFIG, "shard_group_size": 2})
    compiled = zc.compile(model, backend="aot_eager")
    losses = [_step(compiled, opt, batches[step, 0, rank].to(device)) for step in range(STEPS)]
    assert not compiled.eager
    assert zs.engine_state(model).shard_group.size == 2
    torch.testing.assert_close(losses, ref_losses, rtol=1e-5, atol=1e-6)
    full = zs.full_state_dict(model)
    for name, ref in ref_state.items():
        torch.testing.assert_close(full[name], ref, rtol=1e-5, atol=1e-6, msg=name)
    assert compiled.compiles == 1


@pytest.mark.gpu
def test_compiled_hybrid_sharding(device: str) -> None:
    world_fits(device, 4)
    run_ranks(_hybrid, 4, device, device=device)


def _tensor_parallel_case(sp: bool, root: str, device: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    from tests.engine import _tp
    from tests.engine.test_tensor_parallel import engine_config

    mesh = init_device_mesh(device, (1, 2), mesh_dim_names=("dp", "tp"))
    data = _tp.batches(STEPS, 1, 1)
    _, reference = _tp.split_model(mesh, sp=sp, seed=11)
    ref_losses, ref_norms, ref_state = _tp.reference_run(reference, data, 0.5)

    def build() -> tuple[Any, zs.ZeroOptimizer, Any]:
        model, _ = _tp.split_model(mesh, sp=sp, seed=11)
        cfg = engine_config(3, "fp32")
        model, opt = zs.initialize(model, _tp.make_optimizer(model), cfg, device_mesh=mesh)
        return model, opt, zc.compile(model, backend="aot_eager")

    def train(
        opt: zs.ZeroOptimizer, compiled: Any, steps: range
    ) -> tuple[list[float], list[float]]:
        losses, norms = [], []
        for step in steps:
            loss = _tp.loss_fn(compiled, data[step, 0, 0].to(device))
            loss.backward()
            norms.append(float(opt.clip_grad_norm_(0.5)))
            opt.step()
            opt.zero_grad()
            losses.append(float(loss.detach()))
        return losses, norms

    model, opt, compiled = build()
    losses, norms = train(opt, compiled, range(2))
    zs.save_checkpoint(compiled, opt, root, step=2, overwrite=True)
    more = train(opt, compiled, range(2, STEPS))
    assert not compiled.eager and compiled.compiles == 1
    torch.testing.assert_close(losses + more[0], ref_losses, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(norms + more[1], ref_norms, rtol=1e-5, atol=1e-6)
    full = zs.full_state_dict(model)
    for name, ref in ref_state.items():
        torch.testing.assert_close(full[name], ref, rtol=1e-5, atol=1e-6, msg=name)
    again, opt2, compiled2 = build()
    assert zs.load_checkpoint(compiled2, opt2, root) == 2
    train(opt2, compiled2, range(2, STEPS))
    for name, value in zs.full_state_dict(again).items():
        assert torch.equal(value, full[name]), f"{name}: the resume is not bit-identical"


def _tensor_parallel(root: str, device: str) -> None:
    cases = [{"sp": False}, {"sp": True}]
    run_each(cases, lambda sp: _tensor_parallel_case(sp, f"{root}/{int(sp)}", device))


@pytest.mark.gpu
def test_compiled_tensor_parallel(tmp_path: Any, device: str) -> None:
    world_fits(device, 2)
    run_ranks(_tensor_parallel, 2, str(tmp_path), device, device=device)
