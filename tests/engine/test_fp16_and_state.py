"""fp16 loss scaling agreed across ranks, and optimizer state_dict round trips."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

import zeroshard.engine as zs
from tests._dist import run_ranks, world_fits
from tests.engine._models import global_batches, loss_fn, make_model, make_optimizer


def _params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return zs.full_state_dict(model)


def _fp16_overflow(device: str, stage: int) -> None:
    rank = dist.get_rank()
    model = make_model(3).to(device)
    cfg = {"stage": stage, "compute_dtype": "fp16", "initial_loss_scale": 1024.0}
    model, opt = zs.initialize(model, make_optimizer(model), cfg)
    batches = global_batches(3, 1, dist.get_world_size(), 2)
    tokens = batches[0, 0, rank].to(device)

    before = _params(model)
    hook = None
    if rank == 1:
        # An overflow on one rank only: its gradients for l1 become inf.
        hook = model.l1.weight.register_hook(lambda g: g * float("inf"))
    loss_fn(model, tokens).backward()
    norm = opt.clip_grad_norm_(1.0)
    opt.step()
    opt.zero_grad()
    assert not torch.isfinite(norm), "every rank must see the overflow"
    assert opt.scaler is not None and opt.scaler.scale == 512.0, "scale halves on every rank"
    assert opt.scaler.skipped_steps == 1, "the skipped step is counted on every rank"
    assert opt.scaler.log_skips == (rank == 0), "and logged on rank 0 only"
    after = _params(model)
    for k in before:
        assert torch.equal(before[k], after[k]), f"{k} changed in a skipped step"

    if hook is not None:
        hook.remove()
    loss_fn(model, batches[1, 0, rank].to(device)).backward()
    opt.step()
    opt.zero_grad()
    assert opt.scaler.scale == 512.0 and opt.scaler.skipped_steps == 1
    moved = _params(model)
    assert not torch.equal(moved["l1.weight"], after["l1.weight"]), "a good step must update"


@pytest.mark.gpu
@pytest.mark.parametrize("stage", [1, 2])
def test_fp16_overflow_on_one_rank_skips_everywhere(stage: int, device: str) -> None:
    world_fits(device, 2)
    run_ranks(_fp16_overflow, 2, device, stage, device=device)


def _train(model: torch.nn.Module, opt: torch.optim.Optimizer, batch: torch.Tensor) -> None:
    loss_fn(model, batch).backward()
    opt.step()
    opt.zero_grad()


def _state_round_trip(device: str) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    batches = global_batches(4, 1, world, 2)
    for stage in (1, 2):
        model = make_model(5).to(device)
        model, opt = zs.initialize(model, make_optimizer(model), {"stage": stage})
        for s in range(2):
            _train(model, opt, batches[s, 0, rank].to(device))
        # Like torch's, the state dict references live tensors: copy it as a save would.
        saved = copy.deepcopy(opt.state_dict())
        _train(model, opt, batches[2, 0, rank].to(device))
        expected = _params(model)
        _train(model, opt, batches[3, 0, rank].to(device))  # move away from it
        opt.load_state_dict(saved)
        _train(model, opt, batches[2, 0, rank].to(device))
        got = _params(model)
        for k in expected:
            assert torch.equal(expected[k], got[k]), f"stage {stage}: {k} differs after reload"
        wrong = dict(saved, world_size=world + 1)
        with pytest.raises(ValueError, match="world size"):
            opt.load_state_dict(wrong)


@pytest.mark.gpu
def test_optimizer_state_dict_round_trip(device: str) -> None:
    world_fits(device, 2)
    run_ranks(_state_round_trip, 2, device, device=device)


def _scheduled_resume(device: str) -> None:
    """An LR scheduler made on the optimizer before its state is loaded (as a resume
    does) drives the learning rate the step uses: the resumed run ends where the
    uninterrupted one does."""
    rank, world = dist.get_rank(), dist.get_world_size()
    batches = global_batches(4, 1, world, 2)
    for stage in (2, 3):
        runs = []
        for resume in (False, True):
            model = make_model(6).to(device)
            model, opt = zs.initialize(model, make_optimizer(model), {"stage": stage})
            sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5**s)
            for s in range(4):
                if resume and s == 2:
                    saved = copy.deepcopy((opt.state_dict(), sched.state_dict()))
                    weights = _params(model)
                    model = make_model(6).to(device)
                    model.load_state_dict(weights)
                    model, opt = zs.initialize(model, make_optimizer(model), {"stage": stage})
                    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5**s)
                    opt.load_state_dict(saved[0])
                    sched.load_state_dict(saved[1])
                _train(model, opt, batches[s, 0, rank].to(device))
                sched.step()
            assert opt.param_groups[0]["lr"] == opt.inner.param_groups[0]["lr"]
            runs.append(_params(model))
        for k in runs[0]:
            assert torch.equal(runs[0][k], runs[1][k]), f"stage {stage}: {k} differs on resume"


@pytest.mark.gpu
def test_lr_scheduler_drives_the_step_after_a_state_load(device: str) -> None:
    world_fits(device, 2)
    run_ranks(_scheduled_resume, 2, device, device=device)


def _not_in_optimizer() -> None:
    model = make_model(0)
    opt = torch.optim.SGD([model.l1.weight], lr=0.1)
    with pytest.raises(ValueError, match="requires grad but is in no optimizer param group"):
        zs.initialize(model, opt, {"stage": 2})
    stale = make_model(0)
    opt2 = make_optimizer(stale)
    loss_fn(stale, torch.zeros(1, 4, dtype=torch.long)).backward()
    opt2.step()
    with pytest.raises(ValueError, match="already has state"):
        zs.initialize(stale, opt2, {"stage": 2})


def test_bad_initialize_inputs() -> None:
    run_ranks(_not_in_optimizer, 1)


def test_initialize_without_a_process_group_names_the_call_to_make() -> None:
    """The pytest process has no process group: the error names the function the docs
    tell users to call (docs/reliability.md), not only torch's."""
    assert not dist.is_initialized()
    model = make_model()
    with pytest.raises(RuntimeError, match=r"call zeroshard\.comm\.init_process_group\(\) first"):
        zs.initialize(model, make_optimizer(model), {"stage": 2})
