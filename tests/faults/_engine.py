"""A small engine run shared by the fault tests: build, train a step, save, compare bits."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

import zeroshard.engine as zs
from tests.engine._models import global_batches, loss_fn, make_model, make_optimizer
from zeroshard.comm import Group

# Short enough that a whole fault case stays within seconds, long enough for 2 busy cores.
TIMEOUT_S = 4.0
# A hang would show as the harness's deadline; anything within this is "prompt".
SLACK_S = 6.0


def build(
    stage: int = 2, group: Group | None = None, device: str = "cpu", **extra: Any
) -> tuple[torch.nn.Module, zs.ZeroOptimizer]:
    """The odd test model under zeroshard (on `device`) with a short collective timeout."""
    model = make_model(11).to(device)
    cfg: dict[str, Any] = {
        "stage": stage,
        "reduce_bucket_bytes": 1500,
        "collective_timeout_s": TIMEOUT_S,
    }
    if stage == 3:
        cfg.update(min_unit_params=1, persistence_threshold=0)
    cfg.update(extra)
    return zs.initialize(model, make_optimizer(model), cfg, group=group)


def train_step(model: torch.nn.Module, opt: zs.ZeroOptimizer, step: int) -> None:
    """One optimizer step on this rank's part of a fixed global batch."""
    rank, world = dist.get_rank(), dist.get_world_size()
    batch = global_batches(4, 1, 12, 1)[step % 4, 0]
    mine = batch.reshape(world, -1, batch.shape[-1])[rank]
    loss_fn(model, mine.to(next(model.parameters()).device)).backward()
    opt.step()
    opt.zero_grad()


def assert_same_bits(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    """Every tensor equal to the bit."""
    assert got.keys() == want.keys()
    for k in want:
        assert torch.equal(got[k], want[k]), f"{k} differs"
