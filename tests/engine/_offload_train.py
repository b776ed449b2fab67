"""The training loop the offload tests compare (test_offload_pipeline.py,
test_offload_blocked.py, test_offload_compiled.py, test_offload_delayed.py,
test_offload_schedules.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

import zeroshard.engine as zs
from tests.engine._models import global_batches, loss_fn


class Trained(NamedTuple):
    """What `train_and_collect` leaves: each step's loss (the mean over its micro-batches,
    summed over ranks), the full state dict, and every trainable flat group's optimizer
    state, on the CPU."""

    losses: list[float]
    weights: dict[str, torch.Tensor]
    state: list[dict[str, torch.Tensor]]


def train_and_collect(
    model: Any,
    opt: Any,
    *,
    steps: int | range,
    accum: int,
    micro: int,
    device: str = "cpu",
    early: bool = False,
    clip: float | None = None,
    lag: bool = False,
    save: Path | None = None,
) -> Trained:
    """`steps` steps (a count from step 0, or the range a resumed run goes over) of `accum`
    micro-batches each: the last backward of a step under `step_in_backward` if `early`;
    gradients clipped to `clip` if given; with `lag`, after each step the parameters are
    set back to the weights the step before published (delay_param_update's lag applied
    by hand to the plain step, as test_offload_delayed.py's reference); a checkpoint of
    the first step to `save` if given."""
    rank, world = dist.get_rank(), dist.get_world_size()
    steps = range(steps) if isinstance(steps, int) else steps
    batches = global_batches(steps.stop, accum, world, micro)
    params = [p for p in model.parameters() if p.requires_grad]
    published = [p.detach().clone() for p in params] if lag else []
    losses = []
    for step in steps:
        total = torch.zeros((), device=device)
        for a in range(accum):
            loss = loss_fn(model, batches[step, a, rank].to(device)) / accum
            total += loss.detach()
            if early and a == accum - 1:
                with opt.step_in_backward():
                    loss.backward()
            else:
                loss.backward()
        if clip is not None:
            opt.clip_grad_norm_(clip)
        opt.step()
        opt.zero_grad()
        if lag:
            with torch.no_grad():
                for p, before in zip(params, published, strict=True):
                    now = p.detach().clone()
                    p.copy_(before)
                    before.copy_(now)
        dist.all_reduce(total)
        losses.append(float(total))
        if save is not None and step == steps[0]:
            zs.save_checkpoint(model, opt, save, step=step + 1)
    weights = zs.full_state_dict(model)
    state = [
        {k: v.detach().to("cpu", copy=True) for k, v in opt.state[g.master].items()}
        for g in opt.flat_groups
        if g.trainable
    ]
    return Trained(losses, weights, state)
