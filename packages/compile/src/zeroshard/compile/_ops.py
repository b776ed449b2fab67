"""Custom ops that put stage-3 communication into a traced graph.

`zeroshard::gather(shard, key, world, dtype, reduce_dtype)` casts this rank's flat
shard to `dtype` and all-gathers it into a new full flat buffer; its autograd formula
reduce-scatters the full gradient (cast to `reduce_dtype`) back to the shard's size, so
AOTAutograd puts `zeroshard::reduce_scatter` into the backward graph by itself.
`zeroshard::gather_fp8(shard, key, world, dtype, scales)` is the gather of a flat group
of torchao's fp8 weights ([Note: the fp8 gather] in zeroshard.engine): the shard cast to
fp8, each weight's part with its scale, then all-gathered; it has no autograd formula of
its own (`_float8.GatheredFloat8` routes the weights' gradients). `zeroshard::release(
buffer, key)` marks the point after a buffer's last use (see [Note: what release does]).
Every op has a fake kernel, so Dynamo and AOTAutograd trace them by shape alone.

Ops carry an integer `key` rather than a process group (ops take only tensors and
scalars): `register_target` maps it to the `Group` to talk on, the engine's `EngineStats`
to count into, what a reduce-scatter's sum is divided by (the group's size, or a group of
its own's gradient divide factor) and, under hybrid sharding, the `replicate` group its
result is then averaged over (the ranks holding the same shard).
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass
from typing import Any

import torch

from zeroshard.comm import Group
from zeroshard.engine import (
    ComputeCast,
    EngineStats,
    Float8Wire,
    average_replicas,
    gather_shards,
    reduce_scatter_grads,
)


@dataclass(frozen=True)
class _Target:
    process_group: Group
    stats: EngineStats
    label: str
    replicate: Group | None
    wire: Float8Wire | None
    divisor: float


_TARGETS: dict[int, _Target] = {}


def register_target(
    process_group: Group,
    stats: EngineStats,
    label: str,
    replicate: Group | None = None,
    wire: Float8Wire | None = None,
    divisor: float | None = None,
) -> int:
    """A key under which the ops find `process_group` (and `replicate`, under hybrid
    sharding; `wire`, for a group of fp8 weights; `divisor`, what a reduce-scatter's sum
    is divided by, None: the group's size) and count into `stats`: the smallest one no
    live model holds."""
    # Keys are constants in the traced graphs, so in the compile caches' keys too: a model
    # compiled after an earlier one was dropped gets the keys that one had, and so loads
    # its compiled code (with ever-new keys it would miss every cache, in-process too).
    key = next(k for k in itertools.count() if k not in _TARGETS)
    size = process_group.size if divisor is None else divisor
    _TARGETS[key] = _Target(process_group, stats, label, replicate, wire, size)
    return key


def unregister_target(key: int) -> None:
    """Forget a key (its model is gone)."""
    _TARGETS.pop(key, None)


def _target(key: int) -> _Target:
    target = _TARGETS.get(key)
    if target is None:
        raise RuntimeError(f"zeroshard op called with unknown key {key}: was its model deleted?")
    return target


@torch.library.custom_op("zeroshard::gather", mutates_args=())
def gather(
    shard: torch.Tensor, key: int, world: int, dtype: torch.dtype, reduce_dtype: torch.dtype
) -> torch.Tensor:
    """All-gather `shard`, cast to `dtype` first, into a new flat buffer of world x its
    size, in place as the eager gather (the engine's `gather_shards`)."""
    target = _target(key)
    out = torch.empty(shard.numel() * world, dtype=dtype, device=shard.device)
    # The cast writes this rank's part: only `dtype` bytes travel (the fused downcast).
    label = f"compiled gather of {target.label}"
    gather_shards(target.process_group, ComputeCast(dtype), shard.detach(), out, label=label).wait()
    target.stats.gathered(out.nbytes)
    return out


@gather.register_fake
def _gather_fake(
    shard: torch.Tensor, key: int, world: int, dtype: torch.dtype, reduce_dtype: torch.dtype
) -> torch.Tensor:
    return shard.new_empty(shard.numel() * world, dtype=dtype)


@torch.library.custom_op("zeroshard::gather_fp8", mutates_args=())
def gather_fp8(
    shard: torch.Tensor, key: int, world: int, dtype: torch.dtype, scales: torch.Tensor
) -> torch.Tensor:
    """All-gather `shard` cast to fp8 `dtype` (each weight's part with its scale of
    `scales`) into a new flat buffer of world x its size; in place, as the eager gather."""
    target = _target(key)
    wire = wire_of(key)
    if scales is not wire.scales:  # the graph's input may be a copy of them
        wire = dataclasses.replace(wire, scales=scales)
    out = torch.empty(shard.numel() * world, dtype=dtype, device=shard.device)
    label = f"compiled fp8 gather of {target.label}"
    gather_shards(target.process_group, wire, shard.detach(), out, label=label).wait()
    target.stats.gathered(out.nbytes)
    return out


@gather_fp8.register_fake
def _gather_fp8_fake(
    shard: torch.Tensor, key: int, world: int, dtype: torch.dtype, scales: torch.Tensor
) -> torch.Tensor:
    return shard.new_empty(shard.numel() * world, dtype=dtype)


def wire_of(key: int) -> Float8Wire:
    """How the fp8 group of `key` travels."""
    wire = _target(key).wire
    if wire is None:
        raise RuntimeError(f"zeroshard op key {key} is not a group of fp8 weights")
    return wire


@torch.library.custom_op("zeroshard::reduce_scatter", mutates_args=())
def reduce_scatter(full: torch.Tensor, key: int, world: int) -> torch.Tensor:
    """Average `full` over ranks (or sum it and divide by the group's divisor) and return
    this rank's 1/world part of it (then averaged over the replicas under hybrid
    sharding)."""
    target = _target(key)
    send = full.contiguous()
    average = target.divisor == target.process_group.size
    out, handle = reduce_scatter_grads(
        target.process_group,
        send,
        op="avg" if average else "sum",
        in_place=False,
        label=f"compiled reduce-scatter of {target.label}",
    )
    handle.wait()
    if not average:
        out.div_(target.divisor)
    target.stats.reduced(send.nbytes)
    if target.replicate is not None:
        label = f"compiled replica average of {target.label}"
        average_replicas(target.replicate, out, label=label)
    return out


@reduce_scatter.register_fake
def _reduce_scatter_fake(full: torch.Tensor, key: int, world: int) -> torch.Tensor:
    return full.new_empty(full.numel() // world)


def _gather_setup(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
    shard, key, world, _, reduce_dtype = inputs
    ctx.key, ctx.world, ctx.reduce_dtype, ctx.shard_dtype = key, world, reduce_dtype, shard.dtype


def _gather_backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None, None]:
    # The gradient of a gather is the reduce-scatter of the full gradient (in the reduce
    # dtype), back in the shard's dtype.
    full = grad.to(ctx.reduce_dtype)
    shard = torch.ops.zeroshard.reduce_scatter(full, ctx.key, ctx.world)
    return shard.to(ctx.shard_dtype), None, None, None, None


gather.register_autograd(_gather_backward, setup_context=_gather_setup)


# [Note: what release does] Gathered buffers are ordinary graph values: the compiled code
# frees each one after its last use (Python codegen drops the reference, inductor frees or
# reuses the buffer). `release` is placed right after that last use, so it is the last use:
# the buffer dies there and nowhere later, and the op accounts for the bytes. It must not
# free the storage itself: inductor may hand a dead buffer's memory to a later buffer.
@torch.library.custom_op("zeroshard::release", mutates_args=())
def release(buffer: torch.Tensor, key: int) -> None:
    """Account `buffer` as freed (it is dead after this op; see [Note: what release does])."""
    _target(key).stats.released(buffer.nbytes)


@torch.library.custom_op("zeroshard::account", mutates_args=())
def account(buffer: torch.Tensor, key: int, reduced: bool) -> None:
    """Count a gather (or, if `reduced`, a reduce-scatter) of `buffer` that torch's
    functional collectives ran (see `issue_async`)."""
    stats = _target(key).stats
    if reduced:
        stats.reduced(buffer.nbytes)
    else:
        stats.gathered(buffer.nbytes)


@account.register_fake
def _account_fake(buffer: torch.Tensor, key: int, reduced: bool) -> None:
    return None


def group_name(key: int) -> str:
    """The name torch's functional collectives know the process group of `key` by."""
    return _name(_target(key).process_group)


def rank_of(key: int) -> int:
    """This rank's index in the process group of `key`."""
    return _target(key).process_group.rank


def divisor_of(key: int) -> float:
    """What the reduce-scatter of `key` divides its sum by."""
    return _target(key).divisor


def replicate_of(key: int) -> tuple[str, int] | None:
    """The replicate group of `key` (hybrid sharding) as (name, size), or None."""
    replicate = _target(key).replicate
    return None if replicate is None else (_name(replicate), replicate.size)


def _name(group: Group) -> str:
    pg = group.pg or torch.distributed.group.WORLD
    assert pg is not None
    return str(pg.group_name)


@release.register_fake
def _release_fake(buffer: torch.Tensor, key: int) -> None:
    return None


# Dead-code elimination must keep these although nothing reads their (empty) results.
for _op in (torch.ops.zeroshard.release.default, torch.ops.zeroshard.account.default):
    torch.fx.node.has_side_effect(_op)
