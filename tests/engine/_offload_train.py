"""The training loop the offload bit-identity tests compare (test_offload_pipeline.py,
test_offload_blocked.py)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

import zeroshard.engine as zs
from tests.engine._models import global_batches, loss_fn


def train_and_collect(
    model: Any,
    opt: Any,
    *,
    steps: int,
    accum: int,
    micro: int,
    device: str,
    early: bool,
    clip: float | None,
) -> tuple[dict[str, torch.Tensor], list[dict[str, torch.Tensor]]]:
    """`steps` steps of `accum` micro-batches each (the last backward of a step under
    `step_in_backward` if `early`; gradients clipped to `clip` if given); the full state
    dict and every trainable flat group's optimizer state, on the CPU."""
    rank, world = dist.get_rank(), dist.get_world_size()
    batches = global_batches(steps, accum, world, micro)
    for step in range(steps):
        for a in range(accum):
            loss = loss_fn(model, batches[step, a, rank].to(device)) / accum
            if early and a == accum - 1:
                with opt.step_in_backward():
                    loss.backward()
            else:
                loss.backward()
        if clip is not None:
            opt.clip_grad_norm_(clip)
        opt.step()
        opt.zero_grad()
    state = [
        {k: v.cpu() for k, v in opt.state[g.master].items()} for g in opt.flat_groups if g.trainable
    ]
    return zs.full_state_dict(model), state
