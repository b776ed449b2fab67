"""Stages 1 and 2 against a plain single-process fp32 reference that sees the global batch.

Every rank trains its part of each global batch (split over ranks, then over
accumulation micro-steps); the reference trains the whole global batch at once.
Tolerances: fp32 compute rtol 1e-5 / atol 1e-6 on losses, norms and final parameters.
bf16 compute (bf16 forward/backward, fp32 master and reduction): rtol 2e-2 on losses and
norms, and the parameters' total update over the run (final - initial, all trainable
tensors together) must match the reference's to 10% in norm. bf16 rounding flips the sign
of Adam's updates on tiny gradients, so a few percent is expected; no training at all
would be 100%, which an absolute tolerance on the parameters could not tell apart.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import zeroshard.engine as zs
from tests._dist import run_each, run_ranks, subtests, world_fits
from tests.engine._models import global_batches, loss_fn, make_model, make_optimizer, reference_run

STEPS = 3
MICRO = 2
TOL = {
    "fp32": {"loss": 1e-5, "atol": 1e-6},
    "bf16": {"loss": 2e-2, "atol": 1e-2},
}


def _parity_case(
    device: str,
    stage: int,
    dtype: str,
    accum: int,
    clip: bool,
    checkpoint: bool = False,
    leaf: tuple[str, ...] = (),
    shard_group_size: int | None = None,
) -> None:
    world, rank = dist.get_world_size(), dist.get_rank()
    model = make_model(seed=stage * 10 + accum, checkpoint=checkpoint).to(device)
    batches = global_batches(STEPS, accum, world, MICRO)
    max_norm = 0.5 if clip else None
    ref_losses, ref_norms, ref_state = reference_run(model.cpu(), make_optimizer, batches, max_norm)
    model.to(device)
    initial = {
        k: v.detach().cpu().clone()
        for k, v in model.state_dict().items()
        if k not in ("frozen.weight", "frozen.bias", "offset")
    }
    config = {
        "stage": stage,
        "compute_dtype": dtype,
        "reduce_dtype": "fp32",
        # Small groups: several flat groups and reductions in flight, as on a big model.
        "reduce_bucket_bytes": 1500,
        "max_inflight_reductions": 1,
        # Small gathers in flight after the step, too.
        "allgather_bucket_bytes": 1000,
        "shard_group_size": shard_group_size,
    }
    if stage == 3:
        # Every block a unit (the test model is tiny), prefetch one ahead.
        config.update(min_unit_params=1, persistence_threshold=0, leaf_modules=leaf)
    model, opt = zs.initialize(model, make_optimizer(model), config)
    tol = TOL[dtype]
    for step in range(STEPS):
        total = torch.zeros(1, device=device)
        for a in range(accum):
            tokens = batches[step, a, rank].to(device)
            loss = loss_fn(model, tokens) / accum
            loss.backward()
            total += loss.detach()
        if max_norm is not None:
            norm = opt.clip_grad_norm_(max_norm)
            torch.testing.assert_close(
                float(norm), ref_norms[step], rtol=tol["loss"], atol=tol["atol"]
            )
        opt.step()
        opt.zero_grad()
        dist.all_reduce(total)
        torch.testing.assert_close(
            float(total) / world, ref_losses[step], rtol=tol["loss"], atol=tol["atol"]
        )
    full = zs.full_state_dict(model)
    assert full.keys() == ref_state.keys()
    if dtype == "fp32":
        for name, ref in ref_state.items():
            torch.testing.assert_close(full[name], ref, rtol=1e-5, atol=1e-6, msg=name)
    else:
        ours = torch.cat([(full[k] - v).reshape(-1) for k, v in initial.items()])
        theirs = torch.cat([(ref_state[k] - v).reshape(-1) for k, v in initial.items()])
        err = float((ours - theirs).norm() / theirs.norm())
        assert err < 0.10, f"the update differs from the reference's by {err:.1%}"
    # The frozen layer must be bitwise untouched.
    torch.testing.assert_close(full["frozen.weight"], ref_state["frozen.weight"], rtol=0, atol=0)


def _parity(device: str) -> None:
    cases = subtests({"stage": [1, 2], "dtype": ["fp32", "bf16"], "accum": [1, 2], "clip": [0, 1]})
    run_each(cases, lambda **c: _parity_case(device, **c))


def _parity3(device: str) -> None:
    # Activation checkpointing and a leaf block each pair with every dtype/accum/clip
    # value without running the whole product (the suite runs on 2 cores).
    cases = [
        dict(c, stage=3, checkpoint=bool(c["clip"]), leaf=("blocks.1",) if c["accum"] == 2 else ())
        for c in subtests({"dtype": ["fp32", "bf16"], "accum": [1, 2], "clip": [0, 1]})
    ]
    run_each(cases, lambda **c: _parity_case(device, **c))


@pytest.mark.gpu
@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_stage12_parity(world_size: int, device: str) -> None:
    world_fits(device, world_size)
    run_ranks(_parity, world_size, device, device=device)


@pytest.mark.gpu
@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_stage3_parity(world_size: int, device: str) -> None:
    world_fits(device, world_size)
    run_ranks(_parity3, world_size, device, device=device)


def _hybrid(device: str) -> None:
    # 4 ranks as 2 replicas of shard groups of 2: still the single-process reference.
    cases = [dict(c, dtype="fp32", accum=1, clip=1) for c in subtests({"stage": [1, 2, 3]})]
    run_each(cases, lambda **c: _parity_case(device, shard_group_size=2, **c))


@pytest.mark.gpu
def test_hybrid_sharding_parity(device: str) -> None:
    world_fits(device, 4)
    run_ranks(_hybrid, 4, device, device=device)
