"""The offloaded step: reduce-dtype host gradients stepped one group at a time.

Bit for bit, offload on trains like offload off (fp32 gradient shards on the rank's
device, one optimizer step over all of them; on a GPU, where that step would run other
kernels, like the serial CPU step over every group at once, today's offloaded step, with
deterministic algorithms): the same weights and optimizer state after
several steps, at stages 1-3, with gradient accumulation, clipping, fp16 loss scaling,
a share offloaded and offload_params, for an optimizer outside the per-group pipeline,
and with the CPU step inside backward (`step_in_backward`), which refuses what it cannot
do (stage 1, fp16, other optimizers, clipping after it) with a clear error. The host
keeps 6 bytes per offloaded element (fp32 master, bf16 gradient, this from the first
backward on) besides the optimizer state until a micro-step accumulates, which adds an
fp32 gradient (4 bytes); with bf16 masters and offload_params under step_in_backward, 2
(the bf16 master, which is the compute shard; no gradient held), as the planner counts.
The wrapped optimizer's step hooks run once per step.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
import torch.distributed as dist

import zeroshard.engine as zs
from tests._dist import run_each, run_ranks, subtests, world_fits
from tests.engine._models import global_batches, loss_fn, make_model, make_optimizer
from tests.engine._offload_train import train_and_collect
from zeroshard.engine.planner._estimate import estimate
from zeroshard.engine.runtime.offload._plan import GRAD_STAGING

STEPS = 3
MICRO = 2


class _OwnAdamW(torch.optim.AdamW):
    """An optimizer the pipeline does not know: it gets one step over every group."""


def _train(
    device: str,
    stage: int,
    dtype: str,
    accum: int,
    clip: float | None,
    own: bool,
    offload: bool,
    early: bool = False,
    ratio: float = 1.0,
    params: bool = False,
) -> tuple[dict[str, torch.Tensor], list[dict[str, torch.Tensor]], dict[str, int]]:
    model = make_model(seed=stage).to(device)
    inner = make_optimizer(model)
    if own:
        inner = _OwnAdamW(inner.param_groups, lr=1e-3, betas=(0.9, 0.95))
    calls = {"pre": 0, "post": 0}
    inner.register_step_pre_hook(lambda *_: calls.__setitem__("pre", calls["pre"] + 1))
    inner.register_step_post_hook(lambda *_: calls.__setitem__("post", calls["post"] + 1))
    cfg: dict[str, Any] = {
        "stage": stage,
        "compute_dtype": dtype,  # gradients are reduced in it too (no reduce_dtype)
        "reduce_bucket_bytes": 1500,
        "offload_optimizer": offload,
    }
    if offload:
        cfg["offload_chunk_bytes"] = 1000  # groups straddle chunks
        cfg.update(offload_ratio=ratio, offload_params=params)
    if stage == 3:
        cfg.update(min_unit_params=1, persistence_threshold=0)
    model, opt = zs.initialize(model, inner, cfg)
    _, weights, state = train_and_collect(
        model, opt, steps=STEPS, accum=accum, micro=MICRO, device=device, early=early, clip=clip
    )
    return weights, state, calls


def _same_case(
    device: str,
    stage: int,
    dtype: str,
    accum: int,
    clip: float | None = None,
    own: bool = False,
    early: bool = False,
    ratio: float = 1.0,
    params: bool = False,
) -> None:
    ours, ours_state, calls = _train(
        device, stage, dtype, accum, clip, own, True, early, ratio, params
    )
    if device == "cpu":
        ref, ref_state, ref_calls = _train(device, stage, dtype, accum, clip, own, offload=False)
    else:
        # Without offload the GPU would step: other kernels. The reference is then the
        # serial CPU step over every group at once (an optimizer outside the pipeline).
        ref, ref_state, ref_calls = _train(
            device, stage, dtype, accum, clip, True, True, False, ratio, params
        )
    # Once per step that was not skipped (fp16 overflow), however many groups it steps.
    assert calls == ref_calls and calls["pre"] >= STEPS - 1, (calls, ref_calls)
    for name, want in ref.items():
        assert torch.equal(ours[name], want), f"{name} differs from the step without offload"
    for i, (a, b) in enumerate(zip(ours_state, ref_state, strict=True)):
        for k in b:
            assert torch.equal(a[k], b[k]), f"optimizer state {k} of group {i} differs"


def _same(device: str) -> None:
    if device == "cuda":
        # Bit for bit on the GPU too: no atomics (embedding backward), fixed cuBLAS work.
        os.environ["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"
        torch.use_deterministic_algorithms(True, warn_only=True)
    cases = subtests({"stage": [1, 2, 3], "dtype": ["bf16"], "accum": [1, 2]})
    cases += [{"stage": s, "dtype": "bf16", "accum": 2, "clip": 0.05} for s in (2, 3)]
    cases += [{"stage": 2, "dtype": "fp16", "accum": 1, "clip": 0.05}]
    cases += [{"stage": 2, "dtype": "fp32", "accum": 2, "clip": 0.05}]
    cases += [
        {"stage": s, "dtype": "bf16", "accum": a, "own": True} for s in (2, 3) for a in (1, 2)
    ]
    # A share offloaded under step_in_backward (the device steps the rest at step()); many
    # small groups here, so both parts hold several at either stage.
    cases += [
        {"stage": s, "dtype": "bf16", "accum": 1, "early": True, "ratio": 0.5} for s in (2, 3)
    ]
    cases.append(
        {"stage": 3, "dtype": "bf16", "accum": 1, "early": True, "ratio": 0.5, "params": True}
    )
    run_each(cases, lambda **c: _same_case(device, **c))


@pytest.mark.gpu
@pytest.mark.parametrize("world_size", [1, 2])  # 1: the streams on a one-GPU host
def test_offload_step_is_bit_identical(world_size: int, device: str) -> None:
    world_fits(device, world_size)
    run_ranks(_same, world_size, device, device=device)


def _refusals(device: str) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    batches = global_batches(1, 1, world, MICRO)

    def engine(stage: int, dtype: str = "bf16", own: bool = False) -> tuple[Any, Any]:
        model = make_model(seed=1).to(device)
        inner = make_optimizer(model)
        if own:
            inner = _OwnAdamW(inner.param_groups, lr=1e-3)
        cfg: dict[str, Any] = {"stage": stage, "compute_dtype": dtype, "offload_optimizer": True}
        return zs.initialize(model, inner, cfg)

    for stage, dtype, own, match in [
        (1, "bf16", False, "stage 1 reduces"),
        (2, "fp16", False, "fp16 loss scaling"),
        (2, "bf16", True, "not one of torch's per-element optimizers"),
    ]:
        _, opt = engine(stage, dtype, own)
        with pytest.raises(ValueError, match=match), opt.step_in_backward():
            pass
    model, opt = engine(2)
    with opt.step_in_backward():
        loss_fn(model, batches[0, 0, rank].to(device)).backward()
    with pytest.raises(ValueError, match="clip without it"):
        opt.clip_grad_norm_(1.0)
    with pytest.raises(ValueError, match="has not run: call step"), opt.step_in_backward():
        pass
    opt.step()


@pytest.mark.gpu
def test_step_in_backward_refusals(device: str) -> None:
    world_fits(device, 2)
    run_ranks(_refusals, 2, device, device=device)


def _host_bytes(device: str) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    model = make_model(seed=3).to(device)
    cfg = {"stage": 2, "compute_dtype": "bf16", "offload_optimizer": True}
    model, opt = zs.initialize(model, make_optimizer(model), cfg)
    off = zs.engine_state(model).offload
    assert off is not None
    space = off.layout.num_chunks * off.layout.shard_numel
    biggest = max(g.layout.shard_numel for g in opt.flat_groups if off.holds(g))
    # fp32 master per element, one group's fp32 upcast; the bf16 gradients held until
    # step() once the first one arrives; the bf16 staging slots (pinned on a GPU) once the
    # first gradient passes through one (accumulation's second micro-step).
    fixed = biggest * 4
    staging = GRAD_STAGING * biggest * 2
    assert off.nbytes().host == space * 4 + fixed
    batches = global_batches(3, 2, world, MICRO)
    loss_fn(model, batches[0, 0, rank].to(device)).backward()
    opt.step()
    opt.zero_grad()
    assert off.nbytes().host == space * 6 + fixed, "a step without accumulation grew the host"
    for a in range(2):
        loss_fn(model, batches[1, a, rank].to(device)).backward()
    opt.step()
    grown = space * 10 + fixed + staging
    assert off.nbytes().host == grown, "accumulation adds one fp32 gradient and the slots"
    _host_bytes_in_backward(device, batches)


def _host_bytes_in_backward(device: str, batches: torch.Tensor) -> None:
    """Stage 3, offload_params, bf16 masters, each backward under step_in_backward: the
    masters are the host's compute shards (2 bytes an element) and no gradient is held,
    each passes through a staging slot; the planner counts the same bytes."""
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = {
        "stage": 3,
        "compute_dtype": "bf16",
        "master_dtype": "bf16",
        "offload_optimizer": True,
        "offload_params": True,
        "min_unit_params": 1,
        "persistence_threshold": 0,
    }
    model = make_model(seed=3).to(device)
    model, opt = zs.initialize(model, make_optimizer(model), cfg)
    off = zs.engine_state(model).offload
    assert off is not None and off.compute_host is not None
    assert off.compute_host.data_ptr() == off.master.data_ptr(), "the masters are the shards"
    on_host = [g for g in opt.flat_groups if off.holds(g)]
    space = off.layout.num_chunks * off.layout.shard_numel
    biggest = max(g.layout.shard_numel for g in on_host)
    # bf16 staging slots; one group's fp32 upcast and its bf16 cast (AdamW, not fused).
    fixed = GRAD_STAGING * biggest * 2 + biggest * 6
    for step in range(2):
        with opt.step_in_backward():
            loss_fn(model, batches[step, 0, rank].to(device)).backward()
        assert all(g.grad_shard is None for g in on_host), "a gradient stepped was kept"
        opt.step()
        opt.zero_grad()
    with torch.device("meta"):
        meta = make_model(seed=3)
    moved = [g for g in on_host if g.trainable]
    state = sum(t.nbytes for g in moved for t in opt.state[g.master].values() if t.dim())

    def planned(in_backward: bool) -> int:
        est = estimate(
            meta,
            cfg,
            world,
            MICRO,
            batches.shape[-1],
            optimizer=make_optimizer(meta),
            step_in_backward=in_backward,
        )
        return est.host - state

    assert off.nbytes().host == space * 2 + fixed == planned(True)
    # A backward outside step_in_backward holds every gradient until step(): 2 bytes more.
    loss_fn(model, batches[2, 0, rank].to(device)).backward()
    opt.step()
    opt.zero_grad()
    # The slots stay (made by the backwards under step_in_backward): a run that never
    # steps in backward makes none.
    staging = GRAD_STAGING * biggest * 2
    assert off.nbytes().host == space * 4 + fixed == planned(False) + staging


@pytest.mark.gpu
def test_offload_host_bytes_per_element(device: str) -> None:
    world_fits(device, 2)
    run_ranks(_host_bytes, 2, device, device=device)
