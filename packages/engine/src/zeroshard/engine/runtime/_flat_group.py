"""`FlatParamGroup`: parameters flattened into one buffer, with this rank's master shard.

The core (index, key, names, parameters, layout, process group) is the same in every
mode; where the master and gradient shard live is the group's `home`, how its shard
travels its `wire` ([Note: home and wire] in _home.py), and the storage of the
parameters differs by stage. Stages 1 and 2 (`ReplicatedStorage`) keep every parameter
whole on every rank, as views of `param_buffer` (compute dtype); each rank owns one even
shard of the master weights and of the gradient. The optimizer steps the master shards;
the updated shards are sent through the wire and all-gathered back into `param_buffer`.

Stage 3 (`ShardedStorage`) keeps only the master shard: each gather has the wire cast
the home's shard first, so only the wire's bytes travel (keeping a compute-dtype copy of
the shard would save that small cast at the price of memory); `param_buffer` has storage
only while the group's unit is gathered. A group whose wire sends another dtype than the
compute dtype (torchao's fp8 weights: [Note: the fp8 gather] in _float8_gather.py) keeps
its buffer in that dtype, and its parameters hold stand-ins of their shapes while
gathered.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from zeroshard.comm import Group, Handle, completed_handle
from zeroshard.engine.runtime._collectives import gather_shards
from zeroshard.engine.runtime._grad_destination import GradDestination
from zeroshard.engine.runtime._home import Home, HomeBuilder
from zeroshard.engine.runtime._tensor_parallel import data_of, like_param, local_shape, point_at
from zeroshard.engine.runtime._wire import Wire, WireBuilder
from zeroshard.partition import FlatLayout, FlattenTier, GroupKey, flatten_params, flatten_shard

log = logging.getLogger("zeroshard.engine")


@dataclass(eq=False)
class ReplicatedStorage:
    """Stages 1/2: every parameter whole on every rank, as views of `param_buffer`."""

    param_buffer: torch.Tensor
    views: list[torch.Tensor]
    # Stage 1 only: the full gradient, in the compute dtype; `params[i].grad` are views.
    grad_buffer: torch.Tensor | None


@dataclass(eq=False)
class ShardedStorage:
    """Stage 3: `param_buffer` has storage only while the group's unit is gathered.

    One buffer for the group's whole life: only its storage is resized (see [Note:
    released storage]), so the views, made once, stay valid across gathers. `slots` are
    the buffer's views, one per slot; `views` what the parameters hold while gathered:
    the same, or `stand_ins` where the buffer holds another dtype than they compute in
    (its wire then reads `slots` for the tensors forward computes with).
    """

    param_buffer: torch.Tensor
    views: list[torch.Tensor]
    slots: list[torch.Tensor]


@dataclass(eq=False)
class FlatParamGroup:
    """One flat group. `names[i]` is the canonical name of `params[i]`; `process_group`
    is the process group it is sharded and reduced over, `grad_divisor` what the sum of
    its ranks' gradients is divided by (the group's size, unless a group of its own was
    given a gradient divide factor: [Note: the gradient divide factor] in
    setup/_placement.py); `home` is where its master and gradient shard live and `wire`
    how its shard travels ([Note: home and wire] in _home.py)."""

    index: int
    key: GroupKey
    names: tuple[str, ...]
    params: tuple[nn.Parameter, ...]
    layout: FlatLayout
    process_group: Group
    home: Home
    wire: Wire
    tier: FlattenTier
    storage: ReplicatedStorage | ShardedStorage
    grad_divisor: float

    @property
    def master(self) -> nn.Parameter:
        """This rank's master shard (the optimizer's parameter), in its home."""
        return self.home.master

    @property
    def grad_shard(self) -> torch.Tensor | None:
        """This rank's gradient shard of the current window (None: none yet)."""
        return self.home.grad_shard

    @property
    def grads(self) -> GradDestination:
        """Where the reduced gradient shard goes, and what reads it back."""
        return self.home.grads

    @property
    def trainable(self) -> bool:
        """Whether this group's parameters take gradients."""
        return self.key.requires_grad

    @property
    def sharded(self) -> bool:
        """Whether the parameters are sharded (stage 3) rather than whole on every rank."""
        return isinstance(self.storage, ShardedStorage)

    @property
    def param_buffer(self) -> torch.Tensor:
        """The flat buffer gathers fill: the compute-dtype one the parameters are views of
        (when gathered), or at stage 3 one of its wire's dtype."""
        return self.storage.param_buffer

    @property
    def grad_buffer(self) -> torch.Tensor | None:
        """Stage 1: the full compute-dtype gradient buffer; None otherwise."""
        return self.storage.grad_buffer if isinstance(self.storage, ReplicatedStorage) else None

    @property
    def shard_range(self) -> tuple[int, int]:
        """This rank's [start, end) in the flat buffer."""
        return self.layout.shard_range(self.process_group.rank)

    def start_gather(self) -> Handle:
        """Stage 3: give `param_buffer` its storage back and all-gather the shards into it.

        [Note: released storage] A released group keeps its `param_buffer` tensor; its
        storage is resized to zero bytes. Autograd may hold views of the buffer for
        backward (`F.linear` saves `weight.t()`): they share the storage, so releasing frees
        the memory all the same, and after this re-gather those views read the gathered
        values again. The parameters themselves point at an empty tensor while released,
        so reading one outside forward gives an empty tensor, never freed memory.
        """
        buffer = self._sharded().param_buffer
        buffer.untyped_storage().resize_(self.layout.padded_numel * buffer.element_size())
        return self._gather_into(buffer, label=f"gather of group {self.index}")

    def _sharded(self) -> ShardedStorage:
        if not isinstance(self.storage, ShardedStorage):
            raise TypeError(f"flat group {self.index} is replicated: it is never gathered")
        return self.storage

    def _gather_into(self, buffer: torch.Tensor, *, label: str) -> Handle:
        shard = self.home.compute_shard()
        return gather_shards(self.process_group, self.wire, shard, buffer, label=label)

    def expose(self) -> None:
        """Point the parameters at their views of `param_buffer` (after a gather's wait);
        a DTensor parameter's local tensor ([Note: DTensor parameters])."""
        for p, v in zip(self.params, self.storage.views, strict=True):
            point_at(p, v)

    def release(self) -> None:
        """Stage 3: free the gathered buffer's memory (see [Note: released storage])."""
        storage = self._sharded()
        storage.param_buffer.untyped_storage().resize_(0)
        # In the parameters' own dtype (the buffer's may be another: fp8).
        empty = storage.views[0].new_empty(0)
        for p in self.params:
            point_at(p, empty)

    def publish(self) -> Handle:
        """After a step, make the updated master shard what forward computes with.

        Stage 3 has nothing to do (gathers read the home's shard, in forward). Stages 1
        and 2 start the all-gather into `param_buffer` through the group's wire.
        """
        if self.sharded:
            return completed_handle()
        return self._gather_into(self.param_buffer, label=f"params of group {self.index}")


def slot_views(buffer: torch.Tensor, layout: FlatLayout) -> list[torch.Tensor]:
    """Views of `buffer` shaped like each slot; the buffer may be of any dtype (offsets
    count elements, so a compute-dtype or gradient buffer shares the layout)."""
    return [buffer[s.offset : s.end].view(s.shape) for s in layout.slots]


def _check_params(named: Sequence[tuple[str, nn.Parameter]], group: Group) -> None:
    for name, p in named:
        if not p.is_floating_point():
            raise ValueError(
                f"parameter {name!r} has dtype {p.dtype}; only floating point is sharded"
            )
        if p.device != group.device and p.device.type != "meta":
            raise ValueError(
                f"parameter {name!r} is on {p.device} but the process group works on "
                f"{group.device}; move the model there before initialize()"
            )


def flat_layout(
    named: Sequence[tuple[str, nn.Parameter]], key: GroupKey, world_size: int, compute: torch.dtype
) -> FlatLayout:
    """The layout of a flat group of `named` sharded over `world_size` ranks (a DTensor
    parameter's slot holds its local tensor)."""
    # 16-byte aligned slots in the compute dtype keep vectorized kernels on their fast path.
    alignment = max(1, 16 // compute.itemsize)
    return FlatLayout.build(
        [(n, local_shape(p)) for n, p in named], key.dtype, world_size, alignment
    )


def build_flat_group(
    index: int,
    key: GroupKey,
    named: Sequence[tuple[str, nn.Parameter]],
    layout: FlatLayout,
    *,
    process_group: Group,
    compute_dtype: torch.dtype,
    stage: int,
    tier: FlattenTier,
    home: HomeBuilder,
    wire: WireBuilder,
    takes_grads: bool = True,
    grad_divisor: float | None = None,
) -> FlatParamGroup:
    """Flatten `named` (one GroupKey, laid out as `layout`) into a flat group whose master
    shard `home` keeps and whose shard travels by `wire`, its summed gradients divided by
    `grad_divisor` (None: `process_group`'s size).

    Stages 1/2 keep the parameters whole, as views of a compute-dtype buffer (stage 1 also
    a full gradient buffer, unless the engine `takes_grads` not: it has no optimizer),
    flattened on `tier`; stage 3 keeps only the master shard and frees the parameters'
    memory.
    """
    _check_params(named, process_group)
    params = tuple(p for _, p in named)
    # What is flattened: each parameter's values on this rank ([Note: DTensor parameters]).
    values = tuple(data_of(p) for p in params)
    start = time.perf_counter()
    rank = process_group.rank
    storage: ReplicatedStorage | ShardedStorage
    if stage == 3:
        shard = flatten_shard(values, layout, rank, device=process_group.device)
        group_home = home.build(index, shard, key.requires_grad)
        del shard
        storage = _sharded_storage(layout, process_group.device, compute_dtype, wire.dtype)
        used = FlattenTier.DEVICE
        slots = storage.slots
    else:
        if wire.dtype != compute_dtype:
            raise ValueError(f"stages 1/2 publish in the compute dtype, not {wire.dtype}")
        flat, used = flatten_params(
            values,
            layout,
            device=process_group.device,
            tier=tier,
            group=process_group if process_group.size > 1 else None,
        )
        lo, hi = layout.shard_range(rank)
        group_home = home.build(index, flat[lo:hi], key.requires_grad)
        param_buffer = flat if compute_dtype == flat.dtype else flat.to(compute_dtype)
        del flat  # the full-precision copy is no longer needed once master and params exist
        keep_grads = stage == 1 and key.requires_grad and takes_grads
        grad_buffer = torch.zeros_like(param_buffer) if keep_grads else None
        storage = ReplicatedStorage(param_buffer, slot_views(param_buffer, layout), grad_buffer)
        slots = []
    log.debug(
        "group %d: %d params, %d elements, flattened on tier %s in %.3fs",
        index,
        len(params),
        layout.numel,
        used.value,
        time.perf_counter() - start,
    )
    group = FlatParamGroup(
        index,
        key,
        tuple(n for n, _ in named),
        params,
        layout,
        process_group,
        group_home,
        wire.build(params, layout, layout.shard_range(rank), slots),
        used,
        storage,
        process_group.size if grad_divisor is None else grad_divisor,
    )
    if isinstance(storage, ShardedStorage):
        group.release()
        return group
    group.expose()
    if storage.grad_buffer is not None:
        for p, g in zip(params, slot_views(storage.grad_buffer, layout), strict=True):
            p.grad = like_param(p, g)
    return group


def _sharded_storage(
    layout: FlatLayout, device: torch.device, compute_dtype: torch.dtype, dtype: torch.dtype
) -> ShardedStorage:
    """Stage 3's gathered buffer in `dtype` (what the wire sends), released until a gather;
    the parameters are views of it, or stand-ins where it holds another dtype."""
    buffer = torch.empty(layout.padded_numel, dtype=dtype, device=device)
    slots = slot_views(buffer, layout)
    views = slots if dtype == compute_dtype else stand_ins(layout, compute_dtype, device)
    return ShardedStorage(buffer, views, slots)


def stand_ins(layout: FlatLayout, dtype: torch.dtype, device: torch.device) -> list[torch.Tensor]:
    """What the parameters hold while gathered into a buffer of another dtype (fp8), whose
    wire gives forward its own tensors: one NaN expanded to each slot's shape, so
    autograd accumulates their gradients as ever and a read of one is NaN, never a value."""
    nan = torch.full((), float("nan"), dtype=dtype, device=device)
    return [nan.expand(s.shape) for s in layout.slots]
