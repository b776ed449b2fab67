"""zeroshard over torch's tensor parallelism (`initialize(..., device_mesh=mesh)`), against
a plain single-process PyTorch run of the unsplit model on the global batch.

Each data-parallel rank trains its part of every global batch (its tensor-parallel
ranks the same part); the reference trains the whole global batch at once, starting from
the same weights. Tolerances are test_parity's: fp32 rtol 1e-5 / atol 1e-6 on losses,
clip norms and final weights; bf16 (bf16 forward/backward, fp32 masters and reduction)
rtol 2e-2 on losses and norms and the total update of the weights within 10% in norm
of the reference's, since bf16 rounding flips the sign of Adam's updates on tiny
gradients (no training at all would be 100%).

Cases: stages 1-3 x fp32/bf16, each pair of stage and dtype with two of the four rows
of an orthogonal array over accumulation, clipping and sequence parallelism (the two
dtypes of one stage together cover all four), at dp 2 x tp 2 (world 4); at dp 1 x tp 2
one row for each pair (every row still appears).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

import zeroshard.engine as zs
from tests._dist import run_each, run_ranks, world_fits
from tests.engine import _tp

STEPS = 3
TOL = {"fp32": {"loss": 1e-5, "atol": 1e-6}, "bf16": {"loss": 2e-2, "atol": 1e-2}}
# (accum, clip, sp): every pair of values of two columns appears in some row.
ROWS = [(1, False, False), (1, True, True), (2, False, True), (2, True, False)]


def cases(dp: int) -> list[dict[str, Any]]:
    """Stage x dtype, each with two rows of `ROWS` (a stage's two dtypes take all four);
    at dp 1 one row each (every row still appears)."""
    out = []
    for stage in (1, 2, 3):
        for k, dtype in enumerate(("fp32", "bf16")):
            half = (k + stage) % 2
            for accum, clip, sp in ROWS[2 * half : 2 * half + 2]:
                out.append(dict(stage=stage, dtype=dtype, accum=accum, clip=clip, sp=sp))
    return out if dp > 1 else [c for i, c in enumerate(out) if i % 4 in (1, 2)]


def engine_config(stage: int, dtype: str) -> dict[str, Any]:
    """Small flat groups (several reductions in flight), every stage-3 block a unit."""
    config: dict[str, Any] = {
        "stage": stage,
        "compute_dtype": dtype,
        "reduce_dtype": "fp32",
        "reduce_bucket_bytes": 600,
        "max_inflight_reductions": 1,
        "allgather_bucket_bytes": 500,
    }
    if stage == 3:
        config.update(min_unit_params=1, persistence_threshold=0)
    return config


def _parity_case(mesh: Any, stage: int, dtype: str, accum: int, clip: bool, sp: bool) -> None:
    dp, dp_rank = mesh["dp"].size(), mesh.get_local_rank("dp")
    model, reference = _tp.split_model(mesh, sp=sp, seed=10 * stage + accum)
    data = _tp.batches(STEPS, accum, dp)
    max_norm = 0.5 if clip else None
    ref_losses, ref_norms, ref_state = _tp.reference_run(reference, data, max_norm)
    model, opt = zs.initialize(
        model, _tp.make_optimizer(model), engine_config(stage, dtype), device_mesh=mesh
    )
    start = zs.full_state_dict(model)  # the reference's initial weights too
    tol = TOL[dtype]
    device = mesh.device_type
    for step in range(STEPS):
        total = torch.zeros(1, device=device)
        for a in range(accum):
            loss = _tp.loss_fn(model, data[step, a, dp_rank].to(device)) / accum
            loss.backward()
            total += loss.detach()
        if max_norm is not None:
            norm = opt.clip_grad_norm_(max_norm)
            torch.testing.assert_close(
                float(norm), ref_norms[step], rtol=tol["loss"], atol=tol["atol"]
            )
        opt.step()
        opt.zero_grad()
        # The mean over the dp ranks is the global batch's loss (tp ranks hold the same).
        dist.all_reduce(total)
        mean = float(total) / dist.get_world_size()
        torch.testing.assert_close(mean, ref_losses[step], rtol=tol["loss"], atol=tol["atol"])
    full = zs.full_state_dict(model)
    assert full.keys() == ref_state.keys()
    if dtype == "fp32":
        for name, ref in ref_state.items():
            torch.testing.assert_close(full[name], ref, rtol=1e-5, atol=1e-6, msg=name)
        return
    trained = [k for k in ref_state if k != "scale"]
    ours = torch.cat([(full[k] - start[k]).reshape(-1) for k in trained])
    theirs = torch.cat([(ref_state[k] - start[k]).reshape(-1) for k in trained])
    err = float((ours - theirs).norm() / theirs.norm())
    assert err < 0.10, f"the update differs from the reference's by {err:.1%}"


def _parity(dp: int, tp: int, device: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device, (dp, tp), mesh_dim_names=("dp", "tp"))
    run_each(cases(dp), lambda **c: _parity_case(mesh, **c))


@pytest.mark.gpu
@pytest.mark.parametrize(("dp", "tp"), [(2, 2), (1, 2)])
def test_tensor_parallel_parity(dp: int, tp: int, device: str) -> None:
    world_fits(device, dp * tp)
    run_ranks(_parity, dp * tp, dp, tp, device, device=device)
