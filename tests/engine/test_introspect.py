"""Gradients and optimizer state read back whole (`zs.full_grad`, `zs.full_optimizer_state`)
and as per-parameter norms (`zs.grad_norms`), against torch DDP and the plain optimizers on
the same gloo ranks (tests/engine/_introspect.py says what is compared, and when).

World 2, OddModel (odd sizes, so slots cross shard boundaries; two param groups; a tied
embedding; a frozen layer), small flat groups. Cases: stages 1-3 in fp32 with accumulation
and clipping; bf16 and fp16 compute; bf16 masters; hybrid sharding (shard groups of one);
CPU offload with an fp32 and a bf16 host gradient (whose clip factor is applied on
reading), and with a delayed step; Muon's sharded momentum and a declared whole-matrix
optimizer's state at its owner; an fp16 overflow; experts on process groups of their
own; tensor parallelism (dp 1 x tp 2, sequence parallel) against the unsplit reference;
and the refusals. The compiled case is tests/compile/test_compiled_introspect.py.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.distributed as dist

import zeroshard.engine as zs
from tests._dist import run_each, run_ranks, world_fits
from tests.engine import _tp
from tests.engine._introspect import check_grads, check_state, close, train_and_check
from tests.engine._models import global_batches, loss_fn, make_model, make_optimizer, muon_and_adamw
from tests.engine.test_expert_groups import Trunk
from tests.engine.test_expert_groups import _loss as expert_loss
from tests.engine.test_whole_matrix import DeclaredMuon
from zeroshard.comm import Group

STEPS = 2
MICRO = 2


def _config(stage: int, dtype: str = "fp32", **extra: Any) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "stage": stage,
        "compute_dtype": dtype,
        "reduce_dtype": "fp32",
        # Several flat groups, parameters cut across shards.
        "reduce_bucket_bytes": 1500,
        **extra,
    }
    if stage == 3:
        cfg.update(min_unit_params=1, persistence_threshold=0)
    return cfg


def _fused(model: torch.nn.Module) -> torch.optim.Optimizer:
    """make_optimizer's AdamW with torch's fused kernel (offload's blocked host step)."""
    groups = [
        {"params": g["params"], "weight_decay": g["weight_decay"]}
        for g in make_optimizer(model).param_groups
    ]
    return torch.optim.AdamW(groups, lr=1e-3, betas=(0.9, 0.95), fused=True)


def _case(
    device: str,
    stage: int,
    dtype: str = "fp32",
    accum: int = 1,
    clip: bool = False,
    tol: float | None = None,
    optimizers: str = "adamw",
    steps: int | None = None,
    **extra: Any,
) -> None:
    world = dist.get_world_size()
    make = {
        "adamw": make_optimizer,
        "fused": _fused,
        "muon": muon_and_adamw,
        "declared": lambda m: muon_and_adamw(m, DeclaredMuon),
    }[optimizers]
    base = make_model(seed=stage + 10 * accum)
    model = copy.deepcopy(base).to(device)
    model, opt = zs.initialize(model, make(model), _config(stage, dtype, **extra))
    batches = global_batches(STEPS, accum, world, MICRO)
    train_and_check(model, opt, base, make, batches, clip=clip, tol=tol, device=device, steps=steps)


def _overflow_case(device: str, stage: int) -> None:
    """fp16: a window that overflows on one rank reads as non-finite on every rank, the
    step skips it and forgets it; the next window reads unscaled (against fp32)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    model = make_model(seed=7).to(device)
    ref = copy.deepcopy(model)
    model, opt = zs.initialize(model, make_optimizer(model), _config(stage, "fp16"))
    batch = global_batches(1, 1, world, MICRO)[0, 0]
    tokens = batch[rank].to(device)
    hook = model.l1.weight.register_hook(lambda g: g * float("inf")) if rank == 0 else None
    loss_fn(model, tokens).backward()
    if hook is not None:
        hook.remove()
    grad = zs.full_grad(model, "l1.weight")
    assert grad is not None and not torch.isfinite(grad).all()
    assert not torch.isfinite(torch.tensor(zs.grad_norms(model)["l1.weight"]))
    opt.step()
    assert opt.scaler is not None and opt.scaler.skipped_steps == 1
    assert zs.full_grad(model, "l1.weight") is None and zs.grad_norms(model) == {}
    assert zs.full_optimizer_state(model, "l1.weight") == {}
    # The next window (no zero_grad: the skip forgot the gradients) reads unscaled.
    loss_fn(model, tokens).backward()
    loss_fn(ref, batch.reshape(-1, batch.shape[-1]).to(device)).backward()
    assert ref.l1.weight.grad is not None
    close(zs.full_grad(model, "l1.weight"), ref.l1.weight.grad, 0.05, "after the skip")


def _experts(device: str) -> None:
    """Experts on process groups of their own (one rank each here): a rank reads its own
    expert's gradient and norm, not a sum over the instances; the trunk's is the mean."""
    rank = dist.get_rank()
    alone = [Group(dist.new_group([r])) for r in range(dist.get_world_size())]
    model = Trunk(rank).to(device)
    ref = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, _ = zs.initialize(model, opt, {"stage": 2}, process_groups={"expert": alone[rank]})
    batch = global_batches(1, 1, 2, MICRO)[0, 0, rank].to(device)
    expert_loss(model, batch).backward()
    expert_loss(ref, batch).backward()
    norms = zs.grad_norms(model)
    for name, p in ref.named_parameters():
        want = p.grad.detach().clone()
        if not name.startswith("expert."):
            dist.all_reduce(want)
            want /= 2
        close(zs.full_grad(model, name), want, None, name)
        close(torch.tensor(norms[name]), want.norm(), None, f"norm of {name}")


def _refusals(device: str) -> None:
    rank = dist.get_rank()
    model = make_model(seed=1).to(device)
    model, _ = zs.initialize(model, make_optimizer(model), _config(2))
    stranger = torch.nn.Parameter(torch.zeros(3))
    for fn in (zs.full_grad, zs.full_optimizer_state):
        for bad, says in (
            ("nope.weight", "'nope.weight' is not a parameter"),
            (stranger, r"shape \(3,\)"),
        ):
            with pytest.raises(ValueError, match=says):
                fn(model, bad)
        # Ranks asking for different parameters: the same error on both, no hang.
        with pytest.raises(ValueError, match=r"ranks disagree .*l1\.weight.*l2\.weight"):
            fn(model, "l1.weight" if rank == 0 else "l2.weight")
    # A tied parameter reads the same under either name, and as the tensor itself.
    loss_fn(model, global_batches(1, 1, 2, MICRO)[0, 0, rank].to(device)).backward()
    # parameter.grad names the way to read it.
    with pytest.raises(RuntimeError, match=r"full_grad\(model, param\)"):
        model.l1.weight.grad.sum()
    by_alias = zs.full_grad(model, "head.weight")
    assert by_alias is not None
    assert torch.equal(by_alias, zs.full_grad(model, model.emb.weight))


def _cases(device: str) -> None:
    cases: list[dict[str, Any]] = [
        {"stage": 1, "accum": 2, "clip": True},
        {"stage": 2, "accum": 2, "clip": True},
        {"stage": 3, "accum": 2, "clip": True},
        {"stage": 1, "dtype": "bf16", "tol": 0.05},
        {"stage": 3, "dtype": "bf16", "accum": 2, "clip": True, "tol": 0.05},
        # bf16 masters: the gradient shards are bf16 too.
        {"stage": 2, "dtype": "bf16", "master_dtype": "bf16", "clip": True, "tol": 0.05},
        # Hybrid sharding: shard groups of one rank, gradients averaged over the replicas.
        {"stage": 3, "accum": 2, "shard_group_size": 1},
        # fp16's loss scale: read unscaled before the clip unscales, and after.
        {"stage": 2, "dtype": "fp16", "clip": True, "tol": 0.05, "initial_loss_scale": 1024.0},
        # Host gradients: fp32 (clipped in place), and bf16 with the clip factor pending.
        {
            "stage": 2,
            "clip": True,
            "offload_optimizer": True,
            "offload_chunk_bytes": 1000,
            "optimizers": "fused",
        },
        {
            "stage": 3,
            "clip": True,
            "tol": 0.02,
            "reduce_dtype": "bf16",
            "offload_optimizer": True,
            "offload_chunk_bytes": 1000,
            "optimizers": "fused",
        },
        # The step runs beside the next window: state read after it settles; the next
        # window computes with older weights than DDP's, so one step is compared.
        {
            "stage": 2,
            "steps": 1,
            "offload_optimizer": True,
            "offload_chunk_bytes": 1000,
            "optimizers": "fused",
            "offload_delay_param_update": True,
        },
        {"stage": 3, "accum": 2, "clip": True, "optimizers": "muon"},
        {"stage": 2, "clip": True, "optimizers": "declared"},
    ]
    run_each(cases, lambda **c: _case(device, **c))
    run_each([{"stage": 1}, {"stage": 3}], lambda **c: _overflow_case(device, **c))
    _experts(device)
    _refusals(device)


@pytest.mark.gpu
def test_gradients_and_state_match_ddp_overflow_and_refusals(device: str) -> None:
    world_fits(device, 2)
    run_ranks(_cases, 2, device, device=device)


def _tensor_parallel(device: str) -> None:
    """Split parameters whole, replicated ones once, sequence parallel's Partial norm
    gradients summed: against the unsplit model on the same (whole) batch."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device, (1, 2), mesh_dim_names=("dp", "tp"))

    def case(stage: int) -> None:
        model, ref = _tp.split_model(mesh, sp=True, seed=stage)
        model, opt = zs.initialize(
            model,
            _tp.make_optimizer(model),
            _config(stage, reduce_bucket_bytes=600),
            device_mesh=mesh,
        )
        ref_opt = _tp.make_optimizer(ref)
        tokens = _tp.batches(1, 1, 1)[0, 0, 0]
        _tp.loss_fn(model, tokens.to(device)).backward()
        _tp.loss_fn(ref, tokens).backward()
        check_grads(model, ref, None, "after backward")
        norm = opt.clip_grad_norm_(0.5)
        close(norm, torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5), None, "clip norm")
        check_grads(model, ref, None, "after clipping")
        opt.step()
        ref_opt.step()
        check_state(model, ref, [ref_opt], None)

    run_each([{"stage": 1}, {"stage": 3}], case)


@pytest.mark.gpu
def test_tensor_parallel(device: str) -> None:
    world_fits(device, 2)
    run_ranks(_tensor_parallel, 2, device, device=device)
