"""`full_grad`, `grad_norms` and `full_optimizer_state` checked against torch DDP on the
same ranks with the same data, at each point of a step's cycle (test_introspect.py and
tests/compile/test_compiled_introspect.py).

Each rank trains a DDP copy of the model beside the engine's, on the same micro-batches
(accumulated under `no_sync`), clipped by torch's function and stepped by the plain
optimizers. After backward, after clipping and after the step, every trainable
parameter's full gradient and norm must be DDP's `.grad` and its norm; after the step
each one's optimizer state must be the plain optimizer's `state[p]`; after `zero_grad`
there is none. In the middle of an accumulation window the gradient so far is the mean
over the ranks of DDP's local (unsynchronized) gradients. `tol` None compares at fp32's
1e-5; a number bounds each tensor's relative error in norm (bf16, fp16 or a bf16
reduction against the fp32 reference).
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import zeroshard.engine as zs
from tests.engine._models import loss_fn

Optimizers = Callable[[nn.Module], torch.optim.Optimizer | list[torch.optim.Optimizer]]


def close(got: torch.Tensor, want: torch.Tensor, tol: float | None, what: str) -> None:
    """`got` is `want`: to fp32's 1e-5, or within `tol` relative error in norm."""
    got, want = got.detach().cpu().float(), want.detach().cpu().float()
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    if tol is None:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=what)
        return
    err = float((got - want).norm() / want.norm().clamp_min(1e-12))
    assert err < tol, f"{what}: relative error {err:.2e} >= {tol}"


def _as_list(made: torch.optim.Optimizer | list[torch.optim.Optimizer]) -> list[Any]:
    return made if isinstance(made, list) else [made]


def check_grads(engine: Any, ref: nn.Module, tol: float | None, when: str) -> None:
    """Every parameter's `full_grad` and `grad_norms` entry against `ref`'s `.grad`."""
    norms = zs.grad_norms(engine)
    trained = {n: p for n, p in ref.named_parameters() if p.requires_grad}
    assert norms.keys() == trained.keys(), f"{when}: {sorted(norms)} != {sorted(trained)}"
    for name, p in ref.named_parameters():
        got = zs.full_grad(engine, name)
        if not p.requires_grad:
            assert got is None, f"{when}: frozen {name} has a gradient"
            continue
        assert p.grad is not None and got is not None, f"{when}: {name} has no gradient"
        close(got, p.grad, tol, f"{when}: gradient of {name}")
        close(torch.tensor(norms[name]), p.grad.norm(), tol, f"{when}: norm of {name}")


def check_state(engine: Any, ref: nn.Module, ref_opts: list[Any], tol: float | None) -> None:
    """Every parameter's `full_optimizer_state` against the plain optimizers' `state[p]`."""
    for name, p in ref.named_parameters():
        want = next((o.state[p] for o in ref_opts if p in o.state), {})
        got = zs.full_optimizer_state(engine, name)
        assert got.keys() == want.keys(), f"{name}: state {sorted(got)} != {sorted(want)}"
        for key, value in want.items():
            close(got[key], value, None if key == "step" else tol, f"{key} of {name}")


def train_and_check(
    engine: Any,
    opt: zs.ZeroOptimizer,
    base: nn.Module,
    make_opt: Optimizers,
    batches: torch.Tensor,
    *,
    clip: bool,
    tol: float | None,
    device: str,
    steps: int | None = None,
) -> None:
    """Train `engine` (initialized from a copy of `base` with `opt`) and a DDP copy of
    `base` on this rank's part of `batches` ([steps, accum, world, micro, seq + 1]),
    checking the introspection functions at every point (the module docstring); `steps`
    limits the steps whose gradients are compared (a delayed update trains apart after)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    ref = copy.deepcopy(base).to(device)
    ddp = nn.parallel.DistributedDataParallel(ref)
    ref_opts = _as_list(make_opt(ref))
    accum = batches.shape[1]
    for step in range(batches.shape[0] if steps is None else steps):
        for a in range(accum):
            tokens = batches[step, a, rank].to(device)
            last = a == accum - 1
            with contextlib.nullcontext() if last else ddp.no_sync():
                (loss_fn(ddp, tokens) / accum).backward()
            (loss_fn(engine, tokens) / accum).backward()
            if not last:
                _check_window(engine, ref, tol, world, f"step {step}, micro-batch {a}")
        check_grads(engine, ref, tol, f"step {step} after backward")
        if clip:
            opt.clip_grad_norm_(0.5)
            torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
            check_grads(engine, ref, tol, f"step {step} after clipping")
        opt.step()
        for o in ref_opts:
            o.step()
        check_grads(engine, ref, tol, f"step {step} after the step")
        check_state(engine, ref, ref_opts, tol)
        opt.zero_grad()
        for o in ref_opts:
            o.zero_grad()
        assert zs.grad_norms(engine) == {}, "gradient norms after zero_grad"
        assert zs.full_grad(engine, next(iter(dict(ref.named_parameters())))) is None


def _check_window(engine: Any, ref: nn.Module, tol: float | None, world: int, when: str) -> None:
    """Mid-window: the engine's gradient so far is the ranks' mean of DDP's local ones."""
    for name, p in ref.named_parameters():
        if p.grad is None:
            continue
        mean = p.grad.detach().clone()
        dist.all_reduce(mean)
        got = zs.full_grad(engine, name)
        assert got is not None, f"{when}: {name} has no gradient"
        close(got, mean / world, tol, f"{when}: gradient of {name}")
