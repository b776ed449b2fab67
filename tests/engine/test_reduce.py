"""The reducer's buckets are not zero-filled ([Note: bucket fill] in runtime/_reduce.py):
the alignment gaps, the padding and the slots of parameters that got no gradient in a
backward must still add exactly nothing.

A side layer is used on every other micro-batch only, so its slots go missing in half the
backwards (alone in a bucket, and beside parameters that did get gradients); the model
has odd sizes, so every group has alignment gaps and padding. Before each backward, memory
of each bucket's size is filled with NaN and freed, so a bucket that reuses it and is not
zeroed where it must be would carry NaN. After each backward, every rank's fp32 gradient
shard must equal its part of the single-process reference's gradients laid out as the
group (zeros where no gradient is), and the run must end on the reference's weights. The
second micro-batch of each step, and bf16 reduction, reduce-scatter in place ([Note:
in-place reduce-scatter]); the first in fp32 into new memory that becomes the shard.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

import zeroshard.engine as zs
from tests._dist import run_each, run_ranks, subtests
from tests.engine._models import VOCAB, global_batches, loss_fn, make_model, make_optimizer

STEPS, ACCUM, MICRO = 2, 2, 2
# fp32 reduction: exact up to summation order; bf16: each gradient rounded to bf16 before
# the sum, so small sums of rounded terms differ by their rounding (absolute).
TOL = {"fp32": {"rtol": 1e-5, "atol": 1e-6}, "bf16": {"rtol": 2e-2, "atol": 1e-3}}


class _Side(nn.Module):
    """The parity model with a layer on its logits that only some micro-batches use."""

    def __init__(self) -> None:
        super().__init__()
        self.base = make_model(seed=7)
        self.side = nn.Linear(VOCAB, VOCAB)
        self.use_side = True

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        logits: torch.Tensor = self.base(idx)
        return self.side(logits) if self.use_side else logits


def _expected_shard(g: Any, grads: dict[str, torch.Tensor | None]) -> torch.Tensor:
    """The reference's gradients laid out as flat group `g`, this rank's shard of it."""
    full = torch.zeros(g.layout.padded_numel)
    for name, slot in zip(g.names, g.layout.slots, strict=True):
        grad = grads[name]
        if grad is not None:
            full[slot.offset : slot.end] = grad.reshape(-1)
    lo, hi = g.shard_range
    return full[lo:hi]


def _poison(groups: tuple[Any, ...]) -> None:
    # Freed NaN memory of every bucket's size: what a bucket may be allocated from next.
    held = [torch.full((g.layout.padded_numel,), float("nan")) for g in groups]
    del held


def _case(stage: int, reduce_dtype: str) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    model = _Side()
    ref = copy.deepcopy(model)
    ref_opt = make_optimizer(ref, "sgd")
    batches = global_batches(STEPS, ACCUM, world, MICRO)
    # Buckets of a few parameters: the side weight shares one with the others.
    config: dict[str, object] = {
        "stage": stage,
        "reduce_bucket_bytes": 8000,
        "reduce_dtype": reduce_dtype,
    }
    if stage == 3:
        config.update(min_unit_params=1, persistence_threshold=0)
    model, opt = zs.initialize(model, make_optimizer(model, "sgd"), config)
    groups = tuple(g for g in zs.engine_state(model).groups if g.trainable)
    names = dict(ref.named_parameters(remove_duplicate=False))
    for s in range(STEPS):
        for a in range(ACCUM):
            model.use_side = ref.use_side = a % 2 == 0
            loss_fn(ref, batches[s, a].reshape(-1, batches.shape[-1])).backward()
            _poison(groups)
            loss_fn(model, batches[s, a, rank]).backward()
            grads = {n: None if p.grad is None else p.grad.detach() for n, p in names.items()}
            for g in groups:
                shard = g.grad_shard
                assert shard is not None, f"group {g.index} has no gradient shard"
                want = _expected_shard(g, grads)
                label = f"group {g.index}"
                torch.testing.assert_close(
                    shard, want, **TOL[reduce_dtype], msg=lambda m, label=label: f"{label}: {m}"
                )
        ref_opt.step()
        ref_opt.zero_grad()
        opt.step()
        opt.zero_grad()
    full = zs.full_state_dict(model)
    for name, want in ref.state_dict().items():
        torch.testing.assert_close(full[name], want, **TOL[reduce_dtype], msg=name)


def _all() -> None:
    run_each(subtests({"stage": [2, 3], "reduce_dtype": ["fp32", "bf16"]}), lambda **c: _case(**c))


@pytest.mark.parametrize("world_size", [1, 2])
def test_unused_gaps_and_padding_add_nothing(world_size: int) -> None:
    run_ranks(_all, world_size)


def _mixed_dtypes() -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    model = make_model(seed=3)
    config = {"stage": 2, "compute_dtype": "bf16", "reduce_dtype": "fp32"}
    model, _ = zs.initialize(model, make_optimizer(model, "sgd"), config)
    groups = [g for g in zs.engine_state(model).groups if g.trainable]
    local: dict[str, torch.Tensor] = {}
    for g in groups:
        for name, p in zip(g.names, g.params, strict=True):
            p.register_hook(lambda grad, n=name: local.__setitem__(n, grad.detach().float()))
    batches = global_batches(1, 1, world, MICRO)
    loss_fn(model, batches[0, 0, rank]).backward()
    every: list[dict[str, torch.Tensor]] = [{} for _ in range(world)]
    dist.all_gather_object(every, local)
    mean = {n: sum(r[n] for r in every) / world for n in local}
    for g in groups:
        assert g.grad_shard is not None and g.grad_shard.dtype == torch.float32
        # fp32 sums of the same terms in another order: a few ulps. A product rounded to
        # bf16 before the sum would be off by up to 2**-9 of each term.
        torch.testing.assert_close(
            g.grad_shard, _expected_shard(g, dict(mean)), rtol=1e-5, atol=1e-7
        )


def test_fp32_reduction_of_bf16_gradients_scales_in_fp32() -> None:
    """bf16 gradients reduced in fp32 over 3 ranks (1/3 is not a power of two): the
    average's scaling must not round them to bf16 first ([Note: averaging in the copy])."""
    run_ranks(_mixed_dtypes, 3)
