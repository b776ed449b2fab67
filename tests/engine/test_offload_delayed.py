"""offload.delay_param_update (ZeRO-Offload's DPU) against a plain PyTorch reference that
applies the lag explicitly.

What it computes, with w_0 the initial weights and g_k the gradient of window k:
`step()` k steps the masters w_k = AdamW(w_{k-1}, g_k) on the stepping thread and returns,
and the forward and backward of window k are computed at w_{k-2} (w_{-1} = w_0): the
parameters are one step behind the masters, and the weights of step k are published at
step() k+1. The reference keeps two copies, `live` (what forward computes with) and
`master` (torch's fused AdamW on the global batch), and at each step copies the masters
into `live` before stepping them. Checked per step: the loss (computed at the lagged
weights), the masters after the step (`full_state_dict`, which waits for the step in
flight); at the end the parameters forward uses (one step behind). Tolerance as the fp32
parity tests': rtol 1e-5 / atol 1e-6 (on CUDA test_matrix's 1e-4 / 1e-5). The reference
without the lag must fail that check, so the test tells lagged from unlagged. An LR
scheduler changes the lr after each step while the step is still in flight, gradients are
accumulated and clipped, and a share of the state stays on the device (its weights lag
too).
"""

from __future__ import annotations

import copy
from typing import Any
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from torch import nn

import zeroshard.engine as zs
import zeroshard.engine.runtime.offload._host_grads as grads_module
import zeroshard.engine.runtime.offload._step as step_module
from tests._dist import run_each, run_ranks, subtests, world_fits
from tests.engine._models import global_batches, loss_fn, make_model
from tests.engine._offload_train import Trained, train_and_collect

STEPS = 4
MICRO = 2
# On CUDA the ranks' matmuls sum in another order than the CPU reference's, and AdamW's
# first step (m / sqrt(v): the gradient's sign) turns that rounding on an element whose
# gradient is near zero into a few 1e-6 of the weight (seen at 2 ranks: 2.6e-6, 1 element
# of 403), so CUDA gets test_matrix's fp32 tolerance. Either is far below the lag's effect.
TOLERANCE = {"cpu": (1e-5, 1e-6), "cuda": (1e-4, 1e-5)}


def _backward_window(model: nn.Module, micro_batches: torch.Tensor, device: str) -> torch.Tensor:
    """Backward over one accumulation window's micro-batches; their summed loss."""
    accum = micro_batches.shape[0]
    total = torch.zeros(1, device=device)
    for tokens in micro_batches:
        loss = loss_fn(model, tokens.to(device)) / accum
        loss.backward()
        total += loss.detach()
    return total


def _adamw(model: nn.Module) -> torch.optim.Optimizer:
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=1e-3, betas=(0.9, 0.95), fused=True)


def _schedule(opt: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))


def _reference(
    model: nn.Module, batches: torch.Tensor, clip: float | None, *, lag: bool
) -> tuple[list[float], list[dict[str, torch.Tensor]], dict[str, torch.Tensor]]:
    """Losses, the masters after each step, and the weights forward computes with at the
    end, of one process training on the global batch (with the one-step lag or without)."""
    live, master = copy.deepcopy(model), copy.deepcopy(model)
    opt = _adamw(master)
    sched = _schedule(opt)
    pairs = [(a, b) for a, b in zip(live.parameters(), master.parameters(), strict=True)]
    losses, masters = [], []
    for step in batches:
        loss = loss_fn(live, step.reshape(-1, step.shape[-1]))
        loss.backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(live.parameters(), clip)
        for p_live, p_master in pairs:
            p_master.grad, p_live.grad = p_live.grad, None
            if lag:
                # step() k publishes the weights of step k-1, then steps k.
                p_live.data.copy_(p_master.data)
        opt.step()
        opt.zero_grad()
        sched.step()
        if not lag:
            for p_live, p_master in pairs:
                p_live.data.copy_(p_master.data)
        losses.append(float(loss.detach()))
        masters.append({k: v.detach().clone() for k, v in master.state_dict().items()})
    return losses, masters, {k: v.detach().clone() for k, v in live.named_parameters()}


def _named(what: str) -> Any:
    """An `assert_close` message naming `what` and keeping torch's figures."""
    return lambda message: f"{what}: {message}"


def _close(ours: dict[str, torch.Tensor], ref: dict[str, torch.Tensor], device: str) -> bool:
    rtol, atol = TOLERANCE[device]
    return all(torch.allclose(ours[k].cpu(), v, rtol=rtol, atol=atol) for k, v in ref.items())


def _delayed_case(device: str, stage: int, accum: int, clip: int, ratio: float) -> None:
    world, rank = dist.get_world_size(), dist.get_rank()
    rtol, atol = TOLERANCE[device]
    model = make_model(seed=stage * 10 + accum).to(device)
    batches = global_batches(STEPS, accum, world, MICRO)
    max_norm = 0.05 if clip else None
    losses, masters, live = _reference(model.cpu(), batches, max_norm, lag=True)
    _, unlagged, _ = _reference(model, batches, max_norm, lag=False)
    model.to(device)
    config = {
        "stage": stage,
        "reduce_bucket_bytes": 1500,
        "allgather_bucket_bytes": 1000,
        "offload_optimizer": True,
        "offload_ratio": ratio,
        "offload_chunk_bytes": 2000,
        "offload_delay_param_update": True,
    }
    model, opt = zs.initialize(model, _adamw(model), config)
    sched = _schedule(opt)
    for step in range(STEPS):
        total = _backward_window(model, batches[step, :, rank], device)
        if max_norm is not None:
            opt.clip_grad_norm_(max_norm)
        opt.step()
        # Changed while the step is in flight: the step keeps the lr its step() saw.
        sched.step()
        opt.zero_grad()
        dist.all_reduce(total)
        torch.testing.assert_close(float(total) / world, losses[step], rtol=rtol, atol=atol)
        full = zs.full_state_dict(model)
        for name, ref in masters[step].items():
            torch.testing.assert_close(
                full[name], ref, rtol=rtol, atol=atol, msg=_named(f"step {step}, {name}")
            )
        if step >= 1:
            unlagged_match = _close(full, unlagged[step], device)
            assert not unlagged_match, "the masters match the run without a lag"
    # Forward still computes with the weights of the step before the last.
    for name, p in model.named_parameters():
        torch.testing.assert_close(
            p.detach().cpu(), live[name], rtol=rtol, atol=atol, msg=_named(name)
        )


def _delayed(device: str) -> None:
    cases = [
        dict(c, ratio=0.5 if c["stage"] == 2 and c["accum"] == 2 else 1.0)
        for c in subtests({"stage": [1, 2], "accum": [1, 2], "clip": [0, 1]})
    ]
    run_each(cases, lambda **c: _delayed_case(device, **c))


@pytest.mark.gpu
@pytest.mark.parametrize("world_size", [1, 2])
def test_delayed_update_matches_lagged_reference(world_size: int, device: str) -> None:
    world_fits(device, world_size)
    run_ranks(_delayed, world_size, device, device=device)


def _train_lagged(
    device: str,
    stage: int,
    dtype: str,
    accum: int,
    *,
    delayed: bool,
    compiled: bool = False,
    masters: str = "fp32",
) -> Trained:
    """Losses, masters and optimizer state after STEPS steps in `dtype` with clipping:
    with delay_param_update, or with the plain step and the lag applied by hand (after
    each step the parameters are set back to the weights the step before published);
    with offload_compiled_step if `compiled`, masters in `masters`."""
    model = make_model(seed=stage).to(device)
    config = {
        "stage": stage,
        "compute_dtype": dtype,
        "reduce_bucket_bytes": 1500,
        "offload_optimizer": True,
        "offload_chunk_bytes": 2000,
        "offload_delay_param_update": delayed,
        "offload_compiled_step": compiled,
        "master_dtype": masters,
    }
    model, opt = zs.initialize(model, _adamw(model), config)
    return train_and_collect(
        model, opt, steps=STEPS, accum=accum, micro=MICRO, device=device, clip=0.05, lag=not delayed
    )


def _same_as_lag_by_hand(device: str) -> None:
    cases = [{"stage": 2, "dtype": "bf16", "accum": 2}, {"stage": 1, "dtype": "bf16", "accum": 1}]
    cases.append({"stage": 2, "dtype": "fp16", "accum": 1})
    # The compiled host step ([Note: compiled host step]) delayed, against itself lagged.
    cases.append({"stage": 2, "dtype": "bf16", "accum": 2, "compiled": True})
    cases.append({"stage": 2, "dtype": "bf16", "accum": 2, "compiled": True, "masters": "bf16"})
    for case in cases:
        ours = _train_lagged(device, **case, delayed=True)
        ref = _train_lagged(device, **case, delayed=False)
        assert ours[0] == ref[0], (case, ours[0], ref[0])
        torch.testing.assert_close(ours[1], ref[1], rtol=0, atol=0, msg=str(case))
        torch.testing.assert_close(ours[2], ref[2], rtol=0, atol=0, msg=str(case))


@pytest.mark.gpu
@pytest.mark.parametrize("world_size", [1, 2])
def test_delayed_update_is_the_plain_step_lagged(world_size: int, device: str) -> None:
    """In bf16 / fp16, with the gradient factors (clipping, unscaling) and fp32
    accumulation the host keeps per group, bit for bit the plain offloaded step with the
    lag applied by hand; so too with offload_compiled_step, with fp32 or bf16 masters."""
    world_fits(device, world_size)
    run_ranks(_same_as_lag_by_hand, world_size, device, device=device)


def test_config_spellings_and_refusals() -> None:
    flat = zs.ZeroConfig.from_dict({"offload_optimizer": True, "offload_delay_param_update": True})
    assert flat.offload.delay_param_update and flat.to_dict()["offload_delay_param_update"]
    # The spelling of the ZeRO-Offload authors' DeepSpeed branch.
    ds = zs.ZeroConfig.from_dict(
        {
            "zero_optimization": {
                "stage": 2,
                "offload_optimizer": {"device": "cpu"},
                "delay_param_update": True,
            }
        }
    )
    assert ds == flat
    assert not zs.ZeroConfig().offload.delay_param_update, "never a default"
    with pytest.raises(ValueError, match=r"delay_param_update.*needs offload.optimizer"):
        zs.ZeroConfig.from_dict({"offload_delay_param_update": True})
    with pytest.raises(ValueError, match=r"delay_param_update.*needs stage 1 or 2"):
        zs.ZeroConfig.from_dict(
            {"stage": 3, "offload_optimizer": True, "offload_delay_param_update": True}
        )
    with pytest.raises(ValueError, match=r"offload_delay_param_update\) must be true or false"):
        zs.ZeroConfig.from_dict({"offload_optimizer": True, "offload_delay_param_update": 1})
    with pytest.raises(ValueError, match=r"zero_optimization.delay_param_update must be true"):
        zs.ZeroConfig.from_dict({"zero_optimization": {"delay_param_update": "yes"}})


def _refusals(device: str) -> None:
    cfg = {"offload_optimizer": True, "offload_delay_param_update": True}
    unfused = [
        lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3),
        lambda m: torch.optim.SGD(m.parameters(), lr=1e-3, momentum=0.9),
        lambda m: torch.optim.Adam(m.parameters(), lr=1e-3, fused=True, capturable=True),
    ]
    for make in unfused:
        model = make_model().to(device)
        with pytest.raises(ValueError, match=r"delay_param_update .*fused=True"):
            zs.initialize(model, make(model), cfg)
    model = make_model().to(device)
    model, opt = zs.initialize(model, _adamw(model), cfg)
    with pytest.raises(ValueError, match=r"step_in_backward\(\): .*delay_param_update"):
        opt.step_in_backward().__enter__()


@pytest.mark.gpu
def test_refused_on_every_rank(device: str) -> None:
    """An optimizer the delayed step cannot snapshot, and step_in_backward beside it, are
    errors naming the option on every rank."""
    world_fits(device, 2)
    run_ranks(_refusals, 2, device, device=device)


def _checkpoint_in_flight(root: str, device: str) -> None:
    rank = dist.get_rank()
    batches = global_batches(2, 1, dist.get_world_size(), MICRO)
    cfg = {"offload_optimizer": True, "offload_chunk_bytes": 2000}
    model = make_model().to(device)
    model, opt = zs.initialize(model, _adamw(model), dict(cfg, offload_delay_param_update=True))
    for step in range(2):
        loss_fn(model, batches[step, 0, rank].to(device)).backward()
        opt.step()
    # Step 2's CPU step may still be running: the save waits for it.
    zs.save_checkpoint(model, opt, root, step=2)
    saved = zs.full_state_dict(model)
    state = [{k: v.cpu() for k, v in opt.state[g.master].items()} for g in opt.flat_groups]
    assert all(float(s["step"]) == 2 for s in state if s)
    fresh = make_model(seed=7).to(device)
    fresh, fresh_opt = zs.initialize(fresh, _adamw(fresh), cfg)
    assert zs.load_checkpoint(fresh, fresh_opt, root) == 2
    torch.testing.assert_close(zs.full_state_dict(fresh), saved, rtol=0, atol=0)
    loaded = [
        {k: v.cpu() for k, v in fresh_opt.state[g.master].items()} for g in fresh_opt.flat_groups
    ]
    torch.testing.assert_close(loaded, state, rtol=0, atol=0)
    # The loaded weights are published at once: a resumed run has no lag on its first step.
    for name, p in fresh.named_parameters():
        torch.testing.assert_close(p.detach().cpu(), saved[name], rtol=0, atol=0, msg=name)


@pytest.mark.gpu
def test_checkpoint_waits_for_the_step_in_flight(tmp_path: Any, device: str) -> None:
    world_fits(device, 2)
    run_ranks(_checkpoint_in_flight, 2, str(tmp_path), device, device=device)


def _stepped_in_arrival_order(device: str) -> None:
    arrived: list[int] = []
    stepped: list[int] = []
    receive = grads_module.HostGrads.receive
    step_blocked = step_module._step_blocked

    def arrive(self: grads_module.HostGrads, g: Any, out: torch.Tensor, **kw: Any) -> None:
        arrived.append(g.index)
        receive(self, g, out, **kw)

    def step(adam: Any, inner: Any, offload: Any, g: Any, grad: Any) -> None:
        stepped.append(g.index)
        step_blocked(adam, inner, offload, g, grad)

    model = make_model(seed=2).to(device)
    config = {
        "stage": 2,
        "reduce_bucket_bytes": 1500,
        "offload_optimizer": True,
        "offload_chunk_bytes": 2000,
        "offload_delay_param_update": True,
    }
    model, opt = zs.initialize(model, _adamw(model), config)
    batches = global_batches(STEPS, 1, dist.get_world_size(), MICRO)
    with (
        mock.patch.object(grads_module.HostGrads, "receive", arrive),
        mock.patch.object(step_module, "_step_blocked", step),
    ):
        for k in range(STEPS):
            arrived.clear()
            _backward_window(model, batches[k, :, dist.get_rank()], device)
            opt.step()
            opt.settle()
            opt.zero_grad()
            assert len(set(arrived)) >= 3, "too few offloaded groups to tell an order"
            assert stepped == arrived, (k, stepped, arrived)
            stepped.clear()


def test_delayed_step_steps_groups_in_arrival_order(device: str) -> None:
    """The stepping thread steps the groups in the order their gradients arrived, the
    order the next backward's come in, each waiting for its group's step ([Note: delayed
    parameter update])."""
    run_ranks(_stepped_in_arrival_order, 1, device, device=device)
