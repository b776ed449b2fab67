"""`GatheredFloat8`: a flat group of torchao's fp8 weights, gathered in fp8 inside the
compiled graph, as the `Float8TrainingTensor`s their `Float8Linear`s compute with.

The forward gathers with `zeroshard::gather_fp8` and views each weight's slot of the fp8
buffer as torchao's tensor with its scale, so `Float8Linear` casts nothing. The backward
takes each weight's gradient (in the compute dtype, as from any weight), lays them out
as the flat gradient (zeros in the gaps) and reduce-scatters it into the shard's
gradient, as the compute-dtype gather's own formula does. Dynamo leaves the function
whole (`allow_in_graph`, as torchao's own casts); AOTAutograd traces through it, so the
graphs hold `zeroshard::gather_fp8` and `zeroshard::reduce_scatter` for the passes.
"""

from __future__ import annotations

from typing import Any

import torch

from zeroshard.compile._ops import wire_of


@torch._dynamo.allow_in_graph
class GatheredFloat8(torch.autograd.Function):
    """`apply(shard, scales, sink, key, world, reduce_dtype, pieces, slots)`: the weights
    of the fp8 group of op key `key` (`pieces` split its gathered buffer, `slots` are each
    weight's (piece, shape)), one tensor per slot; the gradient goes to `shard`, or where
    the group is homed on the host to its `sink` ([Note: host groups in the graph])."""

    @staticmethod
    def forward(
        ctx: Any,
        shard: torch.Tensor,
        scales: torch.Tensor,
        sink: torch.Tensor | None,
        key: int,
        world: int,
        reduce_dtype: torch.dtype,
        pieces: tuple[int, ...],
        slots: tuple[tuple[int, tuple[int, ...]], ...],
    ) -> tuple[torch.Tensor, ...]:
        wire = wire_of(key)
        full = torch.ops.zeroshard.gather_fp8(shard, key, world, wire.dtype, scales)
        split = full.split(pieces)
        ctx.key, ctx.world, ctx.reduce_dtype = key, world, reduce_dtype
        ctx.pieces, ctx.slots, ctx.shard_dtype = pieces, slots, shard.dtype
        return tuple(
            wire.weight(k, split[piece].view(shape), scales[k])
            for k, (piece, shape) in enumerate(slots)
        )

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        # The flat gradient: each weight's in its piece, zeros in the gaps and the padding.
        parts: list[torch.Tensor | None] = [None] * len(ctx.pieces)
        for grad, (piece, _) in zip(grads, ctx.slots, strict=True):
            if grad is not None:
                parts[piece] = grad.reshape(-1).to(ctx.reduce_dtype)
        device = next(g.device for g in grads if g is not None)
        full = torch.cat(
            [
                p if p is not None else torch.zeros(n, dtype=ctx.reduce_dtype, device=device)
                for p, n in zip(parts, ctx.pieces, strict=True)
            ]
        )
        shard = torch.ops.zeroshard.reduce_scatter(full, ctx.key, ctx.world)
        to_shard = shard.to(ctx.shard_dtype) if ctx.needs_input_grad[0] else None
        to_sink = shard if ctx.needs_input_grad[2] else None
        return to_shard, None, to_sink, None, None, None, None, None
