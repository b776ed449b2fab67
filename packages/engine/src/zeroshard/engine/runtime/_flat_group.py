"""`FlatParamGroup`: parameters flattened into one buffer, with this rank's fp32 master shard.

The core (index, key, names, parameters, layout, process group, master) is the same in
every mode; the storage differs. Stages 1 and 2 (`ReplicatedStorage`) keep every
parameter whole on every rank, as views of `param_buffer` (compute dtype); each rank
owns one even shard of the fp32 master weights and of the fp32 gradient. The optimizer
steps the master shards; the updated shards are cast to the compute dtype and
all-gathered back into `param_buffer`.

Stage 3 (`ShardedStorage`) keeps only the fp32 master shard: each gather casts it to the
compute dtype first, so only compute-dtype bytes travel (keeping a compute-dtype copy of
the shard would save that small cast at the price of memory); `param_buffer` has storage
only while the group's unit is gathered. A group whose `GatherSource` gathers another
dtype (torchao's fp8 weights: [Note: the fp8 gather] in _float8_gather.py) keeps its
buffer in that dtype, and its parameters hold stand-ins of their shapes while gathered.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from zeroshard.comm import Group, Handle, completed_handle
from zeroshard.engine.runtime._gather_source import GatherSource
from zeroshard.engine.runtime._grad_destination import GradDestination
from zeroshard.engine.runtime._group_home import DEVICE_HOME, GroupHome
from zeroshard.engine.runtime._tensor_parallel import data_of, like_param, local_shape, point_at
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
    (its source then reads `slots` for the tensors forward computes with).
    """

    param_buffer: torch.Tensor
    views: list[torch.Tensor]
    slots: list[torch.Tensor]


@dataclass(eq=False)
class FlatParamGroup:
    """One flat group. `names[i]` is the canonical name of `params[i]`; `process_group`
    is the process group it is sharded and reduced over."""

    index: int
    key: GroupKey
    names: tuple[str, ...]
    params: tuple[nn.Parameter, ...]
    layout: FlatLayout
    process_group: Group
    master: torch.Tensor
    tier: FlattenTier
    storage: ReplicatedStorage | ShardedStorage
    # Where the reduced gradient shard goes (`_grad_destination.py`), and what gathers and
    # publishes send (`GatherSource`).
    grads: GradDestination
    source: GatherSource
    # Offload: the gradient shard is this host view (kept allocated between steps,
    # overwritten by a window's first gradient).
    grad_home: torch.Tensor | None
    grad_shard: torch.Tensor | None = None

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
        (when gathered), or at stage 3 one of its `source`'s `gathered_dtype`."""
        return self.storage.param_buffer

    @property
    def grad_buffer(self) -> torch.Tensor | None:
        """Stage 1: the full compute-dtype gradient buffer; None otherwise."""
        return self.storage.grad_buffer if isinstance(self.storage, ReplicatedStorage) else None

    @property
    def shard_range(self) -> tuple[int, int]:
        """This rank's [start, end) in the flat buffer."""
        return self.layout.shard_range(self.process_group.rank)

    def ensure_grad_shard(self) -> torch.Tensor:
        """The gradient shard, zeroed on first use since the last `zero_grad` (fp32, exposed
        as `master.grad`, unless offloaded: see `claim_grad_shard`)."""
        if self.grad_shard is None:
            return self.claim_grad_shard().zero_()
        return self.grad_shard

    def claim_grad_shard(self) -> torch.Tensor:
        """The fp32 gradient shard's memory as `master.grad`, NOT zeroed: for a caller that
        overwrites all of it (the first reduced gradient since the last `zero_grad`).

        An offloaded group reuses its host gradient `grad_home`, in the reduce dtype:
        `grad_shard is None` marks it as holding nothing of this window, so zero_grad never
        touches host memory. Its `master.grad` is set only while the step steps it (see
        [Note: offload host memory] in offload/_host_offload.py).
        """
        assert self.grad_shard is None
        if self.grad_home is not None:
            self.grad_shard = self.grad_home
            return self.grad_home
        self.grad_shard = self.master.grad = torch.empty_like(self.master)
        return self.grad_shard

    def take_master_grad(self) -> None:
        """Autograd accumulated this window's gradient into `master.grad` itself (a
        compiled graph reduce-scatters into it): that tensor is the gradient shard."""
        self.grad_shard = self.master.grad

    def drop_grad_shard(self) -> None:
        """Hold no gradient of this window (freed unless it lives in `grad_home`)."""
        self.grad_shard = self.master.grad = None

    def adopt_grad_shard(self, reduced: torch.Tensor) -> bool:
        """Make `reduced` (a fresh fp32 reduced shard nobody else holds) the gradient shard
        itself, as `master.grad`, instead of copying it into new memory; False where it
        cannot be (an offloaded group's shard lives on the host, or another dtype)."""
        assert self.grad_shard is None
        if (
            self.grad_home is not None
            or reduced.dtype != self.master.dtype
            or reduced.device != self.master.device
            or reduced.shape != self.master.shape
        ):
            return False
        self.grad_shard = self.master.grad = reduced
        return True

    def start_gather(self) -> Handle:
        """Stage 3: give `param_buffer` its storage back and all-gather the compute shard into it.

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
        return self.source.start_gather(self, buffer, label=label)

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

        Stage 3 has nothing to do (gathers read the master, in forward). Stages 1
        and 2 start the all-gather into `param_buffer` through the group's `source`.
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
    home: GroupHome = DEVICE_HOME,
) -> FlatParamGroup:
    """Flatten `named` (one GroupKey, laid out as `layout`) and carve out this rank's fp32
    master shard, kept in `home`.

    Stages 1/2 keep the parameters whole, as views of a compute-dtype buffer (stage 1 also
    a full gradient buffer), flattened on `tier`; stage 3 keeps only the master shard and
    frees the parameters' memory.
    """
    _check_params(named, process_group)
    params = tuple(p for _, p in named)
    # What is flattened: each parameter's values on this rank ([Note: DTensor parameters]).
    values = tuple(data_of(p) for p in params)
    start = time.perf_counter()
    storage: ReplicatedStorage | ShardedStorage
    if stage == 3:
        master, storage, used = _shard(values, layout, process_group, compute_dtype, home)
    else:
        master, storage, used = _replicate(
            values,
            layout,
            process_group,
            compute_dtype,
            tier,
            stage == 1 and key.requires_grad,
            home,
        )
    log.debug(
        "group %d: %d params, %d elements, flattened on tier %s in %.3fs",
        index,
        len(params),
        layout.numel,
        used.value,
        time.perf_counter() - start,
    )
    # The master is an optimizer "parameter": a leaf whose .grad is the gradient shard.
    group = FlatParamGroup(
        index,
        key,
        tuple(n for n, _ in named),
        params,
        layout,
        process_group,
        nn.Parameter(master, key.requires_grad),
        used,
        storage,
        home.grads,
        home.source,
        home.grad,
    )
    if isinstance(storage, ShardedStorage):
        group.release()
        return group
    group.expose()
    if storage.grad_buffer is not None:
        for p, g in zip(params, slot_views(storage.grad_buffer, layout), strict=True):
            p.grad = like_param(p, g)
    return group


def _replicate(
    params: tuple[torch.Tensor, ...],
    layout: FlatLayout,
    process_group: Group,
    compute_dtype: torch.dtype,
    tier: FlattenTier,
    keep_grad_buffer: bool,
    home: GroupHome,
) -> tuple[torch.Tensor, ReplicatedStorage, FlattenTier]:
    flat, used = flatten_params(
        params,
        layout,
        device=process_group.device,
        tier=tier,
        group=process_group if process_group.size > 1 else None,
    )
    lo, hi = layout.shard_range(process_group.rank)
    master = home.master(flat[lo:hi])
    param_buffer = flat if compute_dtype == flat.dtype else flat.to(compute_dtype)
    del flat  # the full-precision copy is no longer needed once master and params exist
    grad_buffer = torch.zeros_like(param_buffer) if keep_grad_buffer else None
    return (
        master,
        ReplicatedStorage(param_buffer, slot_views(param_buffer, layout), grad_buffer),
        used,
    )


def _shard(
    params: tuple[torch.Tensor, ...],
    layout: FlatLayout,
    process_group: Group,
    compute_dtype: torch.dtype,
    home: GroupHome,
) -> tuple[torch.Tensor, ShardedStorage, FlattenTier]:
    shard = flatten_shard(params, layout, process_group.rank, device=process_group.device)
    master = home.master(shard)
    del shard
    device = process_group.device
    dtype = home.source.gathered_dtype(compute_dtype)
    buffer = torch.empty(layout.padded_numel, dtype=dtype, device=device)
    slots = slot_views(buffer, layout)
    views = slots if dtype == compute_dtype else stand_ins(layout, compute_dtype, device)
    return master, ShardedStorage(buffer, views, slots), FlattenTier.DEVICE


def stand_ins(layout: FlatLayout, dtype: torch.dtype, device: torch.device) -> list[torch.Tensor]:
    """What the parameters hold while gathered into a buffer of another dtype (fp8), whose
    source gives forward its own tensors: one NaN expanded to each slot's shape, so
    autograd accumulates their gradients as ever and a read of one is NaN, never a value."""
    nan = torch.full((), float("nan"), dtype=dtype, device=device)
    return [nan.expand(s.shape) for s in layout.slots]
