"""Models converted by torchao's `convert_to_float8_training` under zeroshard, and the fp8
gather (`enable_fsdp_float8_all_gather`).

Parity: against torch DDP + torchao on the same ranks and micro-batches (torchao scales
each rank's activations by their own amax, so a single process on the global batch is
not the reference), fp32 compute, at stages 1-3, hybrid, with accumulation and
clipping, recipes tensorwise (with and without the fp8 gather, and with it under CPU
offload, full and partial: the offloaded groups' fp8 cast reads the compute shard the
host keeps) and rowwise. Tolerance:
rtol 1e-5 on the losses, atol 2e-4 on the final weights. Both cast the same values with
the same scales; they differ only in the order the gradients are summed (all-reduce
against reduce-scatter: 4e-7 on the weights), unless that moves a value across an fp8
rounding boundary: then one rounding differs by an fp8 step and the elements it feeds
take a slightly different Adam update (seen: 8.5e-5 on 12 of 2048 elements, with
accumulation, at stages 2 and 3 alike). 2e-4 is 2% of one step at the learning rate
1e-2; a missed update or a wrong scale is far above it.

The fp8 gather: at bf16 compute, the run with it is bit for bit the run without it (the
compute-dtype gather, then torchao's own cast with the same scales; unclipped, as the
fp8 weights' groups of their own change the order the global norm is summed in, to the
last bit), without offload and under full and partial CPU offload alike; it gathers at most
0.55x the bytes for those weights, and takes its scales with one all-reduce per step.
Where the shards' process group has one rank (one GPU, or hybrid with shard groups of
one) the option gathers in the compute dtype: the same bytes and bits as without it.
Hybrid with the fp8 gather runs on 4 ranks (shard groups of 2). Weights of two fp8
dtypes to gather are refused by name. On the CPU torchao emulates
the fp8 matmuls; `--device cuda` runs the real kernels.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

import zeroshard.engine as zs
from tests._dist import run_each, run_ranks
from tests.engine._float8 import (
    batches,
    ddp_reference,
    make_net,
    make_optimizer,
    train,
)

STEPS = 3
STAGE3 = {"min_unit_params": 1, "persistence_threshold": 0}


def _parity_case(
    device: str,
    stage: int,
    recipe: str,
    gather: bool,
    accum: int,
    clip: bool,
    hybrid: bool,
    offload: float = 0.0,
    shard_group_size: int = 1,
) -> None:
    data = batches(STEPS, accum, dist.get_world_size())
    max_norm = 0.5 if clip else None
    # The option only changes how FSDP gathers; DDP computes the same without it.
    ref = make_net(1, recipe, False, device)
    ref_losses, ref_state = ddp_reference(ref, data, max_norm, device)
    net = make_net(1, recipe, gather, device)
    config: dict[str, Any] = {"stage": stage, **STAGE3}
    if hybrid:
        config["shard_group_size"] = shard_group_size
    if offload:  # `offload` of the masters on the host (offload_ratio)
        config.update(offload_optimizer=True, offload_ratio=offload)
    model, opt = zs.initialize(net, make_optimizer(net), config)
    if gather and stage == 3 and dist.get_world_size() > 1 and not hybrid:
        groups = zs.engine_state(model).groups
        homes = {g.home.kind for g in groups if zs.float8_wire(g) is not None}
        # Offloaded groups gather in fp8 too, and so do those a partial offload leaves.
        want = {zs.HomeKind.HOST} if offload == 1 else {zs.HomeKind.HOST, zs.HomeKind.DEVICE}
        assert homes == (want if offload else {zs.HomeKind.DEVICE}), homes
    losses = train(model, opt, data, max_norm, opt.clip_grad_norm_, device)
    torch.testing.assert_close(losses, ref_losses, rtol=1e-5, atol=0)
    full = zs.full_state_dict(model)
    # Plain weights under the module's own names: no torchao subclass, no extra key.
    assert full.keys() == ref_state.keys()
    for name, ref in ref_state.items():
        assert type(full[name]) is torch.Tensor, name
        torch.testing.assert_close(
            full[name], ref, rtol=0, atol=2e-4, msg=lambda m, name=name: f"{name}: {m}"
        )


def _parity(device: str) -> None:
    cases = [
        dict(stage=stage, recipe=recipe, gather=gather, accum=accum, clip=clip, hybrid=False)
        for stage in (1, 2, 3)
        for (recipe, gather), accum, clip in [
            (("tensorwise", False), 1, True),
            (("tensorwise", True), 2, True),
            (("rowwise", False), 2, False),
        ]
    ]
    cases += [
        dict(stage=stage, recipe="tensorwise", gather=True, accum=1, clip=True, hybrid=True)
        for stage in (2, 3)
    ]
    cases += [
        dict(
            stage=3,
            recipe="tensorwise",
            gather=True,
            accum=accum,
            clip=True,
            hybrid=False,
            offload=ratio,
        )
        for accum, ratio in ((1, 1.0), (2, 0.3))
    ]
    run_each(cases, lambda **c: _parity_case(device, **c))


def _muon_pair(model: torch.nn.Module) -> list[torch.optim.Optimizer]:
    """torch's Muon recipe: Muon on the blocks' matrices (fp8 weights), AdamW on the rest."""
    hidden = [p for n, p in model.named_parameters() if n.startswith("blocks") and p.ndim == 2]
    rest = [p for p in model.parameters() if all(p is not h for h in hidden)]
    muon = torch.optim.Muon(hidden, lr=1e-2, adjust_lr_fn="match_rms_adamw")
    return [muon, torch.optim.AdamW(rest, lr=1e-2, betas=(0.9, 0.95))]


class _StepBoth:
    """The reference's two optimizers stepped as one."""

    def __init__(self, optimizers: list[torch.optim.Optimizer]) -> None:
        self.optimizers = optimizers

    def step(self) -> None:
        for o in self.optimizers:
            o.step()

    def zero_grad(self) -> None:
        for o in self.optimizers:
            o.zero_grad()


def _with_muon(device: str) -> None:
    """fp8 weights gathered in fp8 and stepped by Muon beside AdamW (initialize given both,
    as torch's recipe): the same as torch DDP with torchao and the same two optimizers."""
    data = batches(STEPS, 2, dist.get_world_size())
    ref = make_net(1, "tensorwise", False, device)
    ddp = torch.nn.parallel.DistributedDataParallel(ref)
    ref_opt: Any = _StepBoth(_muon_pair(ref))

    def ref_clip(max_norm: float) -> torch.Tensor:
        return torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm)

    ref_losses = train(ddp, ref_opt, data, 0.5, ref_clip, device)
    net = make_net(1, "tensorwise", True, device)
    model, opt = zs.initialize(net, _muon_pair(net), {"stage": 3, **STAGE3})
    losses = train(model, opt, data, 0.5, opt.clip_grad_norm_, device)
    torch.testing.assert_close(losses, ref_losses, rtol=1e-5, atol=0)
    full = zs.full_state_dict(model)
    for name, want in ref.state_dict().items():
        assert type(full[name]) is torch.Tensor, name
        torch.testing.assert_close(
            full[name], want.detach().cpu(), rtol=0, atol=2e-4, msg=lambda m, n=name: f"{n}: {m}"
        )


def _two_fp8_dtypes(device: str) -> None:
    """Weights of two fp8 dtypes to gather in fp8: refused by name, on every rank."""
    import dataclasses

    from torchao.float8 import convert_to_float8_training
    from torchao.float8.config import CastConfig

    from tests.engine._float8 import float8_config

    net = make_net(3, None, False, device)
    e5m2 = CastConfig(target_dtype=torch.float8_e5m2)
    configs = [
        float8_config("tensorwise", True, device),
        dataclasses.replace(
            float8_config("tensorwise", True, device),
            cast_config_weight=e5m2,
            cast_config_weight_for_grad_input=e5m2,
        ),
    ]
    for block, config in zip(net.blocks, configs, strict=True):
        convert_to_float8_training(block, config=config)
    with pytest.raises(ValueError, match="2 fp8 dtypes"):
        zs.initialize(net, make_optimizer(net), {"stage": 3, **STAGE3})


def _same_as_compute_dtype_gather(device: str, offload: float) -> None:
    """bf16 compute, stage 3: with the fp8 gather and without, the same bits; the bytes.
    `offload` of the masters on the host (0: none)."""
    data = batches(STEPS, 1, dist.get_world_size())
    runs = {}
    for gather in (False, True):
        net = make_net(2, "tensorwise", gather, device)
        config: dict[str, Any] = {"stage": 3, "compute_dtype": "bf16", **STAGE3}
        if offload:
            config.update(offload_optimizer=True, offload_ratio=offload)
        model, opt = zs.initialize(net, make_optimizer(net), config)
        stats = zs.engine_stats(model)
        runtime = zs.engine_state(model).stage3
        assert runtime is not None
        first = runtime.units[0].nbytes  # the root: the one unit without fp8 weights
        before = stats.scale_reductions
        stats.reset()
        # No clipping here: the global norm sums the flat groups' norms, and the fp8
        # weights' groups of their own sum it in another order (the last bit may differ).
        losses = train(model, opt, data, None, opt.clip_grad_norm_, device)
        runs[gather] = (losses, zs.full_state_dict(model), stats.bytes_gathered, first)
        if gather:
            assert before == 1  # the first scales, at initialize
            assert stats.scale_reductions == STEPS  # then one all-reduce per step
        else:
            assert stats.scale_reductions == before == 0
    (losses, state, wide, root), (losses8, state8, narrow, root8) = runs[False], runs[True]
    assert losses8 == losses
    for name, value in state.items():
        assert torch.equal(state8[name], value), name
    # Each step gathers the root once and every block twice (forward, backward).
    ratio = (narrow - STEPS * root8) / (wide - STEPS * root)
    assert 0 < ratio <= 0.55, f"fp8 weights gathered {ratio:.3f}x the bf16 bytes"


def _one_rank_gathers_in_compute_dtype(device: str) -> None:
    """Where the shards' process group has one rank (hybrid with shard groups of one, or
    one GPU), a gather moves nothing: the option then gathers in the compute dtype, as
    without it (the same bytes and bits, no scale all-reduce)."""
    config: dict[str, Any] = {"stage": 3, "compute_dtype": "bf16", **STAGE3}
    if dist.get_world_size() > 1:
        config["shard_group_size"] = 1
    data = batches(STEPS, 1, dist.get_world_size())
    runs = {}
    for gather in (False, True):
        net = make_net(2, "tensorwise", gather, device)
        model, opt = zs.initialize(net, make_optimizer(net), config)
        stats = zs.engine_stats(model)
        stats.reset()
        losses = train(model, opt, data, 0.5, opt.clip_grad_norm_, device)
        runs[gather] = (losses, zs.full_state_dict(model), stats.bytes_gathered, stats.gathers)
        assert stats.scale_reductions == 0
    (losses, state, *moved), (losses8, state8, *moved8) = runs[False], runs[True]
    assert losses8 == losses
    assert moved8 == moved
    for name, value in state.items():
        assert torch.equal(state8[name], value), name


def _all(device: str) -> None:
    if dist.get_world_size() > 1:
        run_each(
            [dict(offload=r) for r in (0.0, 1.0, 0.3)],
            lambda **c: _same_as_compute_dtype_gather(device, **c),
        )
    run_each([{}], lambda: _one_rank_gathers_in_compute_dtype(device))
    run_each([{}], lambda: _two_fp8_dtypes(device))
    run_each([{}], lambda: _with_muon(device))
    _parity(device)


def _hybrid(device: str) -> None:
    """Shard groups of two, replicated twice: the fp8 gather within each shard group."""
    run_each(
        [dict(stage=3, recipe="tensorwise", gather=True, accum=2, clip=True, hybrid=True)],
        lambda **c: _parity_case(device, **c, shard_group_size=2),
    )


@pytest.mark.gpu
def test_float8_training(device: str) -> None:
    pytest.importorskip("torchao")
    # Two ranks, or one on a machine of one GPU (the real fp8 kernels need a GPU each).
    world = 2 if device == "cpu" or torch.cuda.device_count() >= 2 else 1
    run_ranks(_all, world, device, device=device)
    if device == "cpu" or torch.cuda.device_count() >= 4:
        run_ranks(_hybrid, 4, device, device=device)


@pytest.mark.gpu
def test_two_fp8_dtypes_refused_on_one_rank(device: str) -> None:
    """One rank gathers in the compute dtype, but refuses what more ranks would refuse."""
    pytest.importorskip("torchao")
    run_ranks(_two_fp8_dtypes, 1, device, device=device)
