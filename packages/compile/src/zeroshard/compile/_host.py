"""Flat groups homed on the host (CPU offload) inside the compiled graph.

[Note: host groups in the graph]
An offloaded group's master lives on the host; its gathers read the compute shard its
home keeps on the device (`Home.compute_shard`), which the graph takes as an input that
needs no gradient. Its gradient goes to the host in the reduce dtype, as the eager
reducer sends it: the gather's backward reduce-scatters into a *sink*, a leaf of the
shard's size in the reduce dtype that holds no memory (one zero, expanded), whose
accumulated gradient a hook hands to the group's `GradDestination` (offload's
`HostGrads`: copied down, accumulated, stepped) and then drops. The first such hook of a
backward queues the destinations' drain at its end, as the eager reducer's end of
backward does, so the step reads complete gradients.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch.utils.hooks import RemovableHandle

from zeroshard.engine import EngineState, HomeKind


@torch._dynamo.allow_in_graph
class GatheredToHost(torch.autograd.Function):
    """`apply(shard, sink, key, world)`: the compute shard `shard` of the group of op key
    `key` gathered as `zeroshard::gather` does; its gradient reduce-scattered into `sink`
    (in the sink's dtype, the reduce dtype)."""

    @staticmethod
    def forward(ctx: Any, shard: torch.Tensor, sink: torch.Tensor, key: int, world: int) -> Any:
        ctx.key, ctx.world, ctx.reduce_dtype = key, world, sink.dtype
        return torch.ops.zeroshard.gather(shard, key, world, shard.dtype, sink.dtype)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        shard = torch.ops.zeroshard.reduce_scatter(grad.to(ctx.reduce_dtype), ctx.key, ctx.world)
        return None, shard, None, None


def grad_sinks(state: EngineState) -> list[torch.Tensor | None]:
    """Per flat group of `state`, the sink of its gradient where it is trainable and homed
    on the host (None elsewhere)."""
    reduce_dtype = state.config.precision.grad_reduce_dtype
    device = state.shard_group.device
    sinks: list[torch.Tensor | None] = []
    for g in state.groups:
        if g.trainable and g.home.kind is HomeKind.HOST:
            zero = torch.zeros((), dtype=reduce_dtype, device=device)
            sinks.append(zero.expand(g.layout.shard_numel).requires_grad_())
        else:
            sinks.append(None)
    return sinks


def route_host_grads(state: EngineState, sinks: list[torch.Tensor | None]) -> list[RemovableHandle]:
    """Hand each sink's accumulated gradient to its group's destination (see [Note: host
    groups in the graph])."""
    drain = _Drain(state)
    handles = []
    for g, sink in zip(state.groups, sinks, strict=True):
        if sink is not None:
            register = sink.register_post_accumulate_grad_hook  # untyped in torch
            hook = _sink_hook(weakref.ref(g), drain)
            handles.append(register(hook))  # type: ignore[no-untyped-call]
    return handles


class _Drain:
    """The destinations' drain at the end of the backward that gave them gradients."""

    def __init__(self, state: EngineState) -> None:
        groups = [g for g in state.groups if g.home.kind is HomeKind.HOST]
        self._destinations = list({id(g.grads): g.grads for g in groups}.values())
        self._queued = False

    def queue(self) -> None:
        """Drain at the end of the running backward (once)."""
        if not self._queued:
            self._queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._drain)

    def _drain(self) -> None:
        self._queued = False
        for destination in self._destinations:
            destination.drain()


def _sink_hook(group: weakref.ref[Any], drain: _Drain) -> Callable[[torch.Tensor], None]:
    # Weakly, as the masters' hooks (see `_grad_shard_hook` in _capture.py).
    def hook(sink: torch.Tensor) -> None:
        owner = group()
        grad = sink.grad
        sink.grad = None
        if owner is not None and grad is not None:
            drain.queue()
            owner.grads.receive(owner, grad, fresh=True)

    return hook
