"""CPU offload from shard sizes alone: which flat groups go to the host, and the buffers
`HostOffload` allocates for them (`place_offloaded`, which `initialize()` builds from and
the planner counts). Sizes are in elements of one rank's shards, equal on every rank."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from zeroshard.engine.config._config import ZeroConfig
from zeroshard.engine.runtime._group_plan import FlatGroupPlan
from zeroshard.engine.runtime._home import HomeKind
from zeroshard.engine.runtime.offload._fused_adam import STEP_BLOCK
from zeroshard.partition import ChunkLayout

# Pinned slots, each of the largest shard, that a gradient coming down passes through
# rather than lands in: staged under gradient accumulation until its add, or stepped in
# backward until its step (`step_in_backward` without accumulation, where no gradient is
# held until `step()`); two, so that one can fill while the other drains; made when the
# first gradient that passes through one arrives (see [Note: offload stream order] and
# [Note: offload host memory] in _host_offload.py).
GRAD_STAGING = 2


def choose_offloaded(
    shard_numels: Sequence[int],
    trainable: Sequence[bool],
    ratio: float,
    *,
    registration_order: bool,
) -> list[int]:
    """Positions of the groups to offload, ascending. At `ratio` 1, all of them. Below 1,
    trainable groups whose shards make up about `ratio` of the trainable shard elements:
    those whose gradients backward completes first, so that the CPU starts stepping early
    in backward while the groups completed last, the step's tail, stay on the device.
    Frozen groups then stay too: they hold no optimizer state, and counting them would let
    them take the CPU's share. Stage 1/2 groups come in gradient-ready order; stage 3's in
    registration order (`registration_order`), which backward completes about last to
    first. Every rank chooses the same: shard sizes are equal on every rank."""
    if ratio >= 1:
        return list(range(len(shard_numels)))
    total = sum(n for n, t in zip(shard_numels, trainable, strict=True) if t)
    order = range(len(shard_numels))
    chosen: list[int] = []
    taken = 0
    for i in reversed(order) if registration_order else order:
        if trainable[i] and taken < ratio * total:
            chosen.append(i)
            taken += shard_numels[i]
    return sorted(chosen)


@dataclass(frozen=True)
class OffloadSizes:
    """The buffers `HostOffload` allocates on one rank: the offloaded shards laid end to end
    in a chunk space of `chunks`, a master in `master_dtype` (pinned where it goes up to the
    device or is the compute shard; else pageable), the compute-dtype shards (with
    offload_params pinned on the host, the masters themselves where they are in the compute
    dtype; else on the device, cast there from a staging chunk of masters), the step's
    fp32 upcast (pageable: one block where the optimizer steps in blocks, else one shard)
    and its cast to bf16 masters' dtype, and two kinds made when the first gradient that
    needs them arrives: the gradients held until `step()` (`grads_held`), one per chunk
    in the reduce dtype (pinned), and the gradient staging slots (`staged`: pinned), which
    a gradient stepped as it lands passes through (`step_in_backward`, whose groups hold
    none without accumulation) and nothing else without accumulation.

    Not counted: gradient accumulation in a reduce dtype other than fp32 adds an fp32
    gradient per chunk (4 bytes per element) on the first accumulated micro-step, and
    its later micro-steps pass through the staging slots."""

    shard_numels: tuple[int, ...]  # each offloaded shard's elements, in chunk-space order
    offsets: tuple[int, ...]  # each shard's start in the chunk space, in the given order
    chunks: ChunkLayout
    staging_numel: int  # the largest shard: any staged gradient fits in one
    master_dtype: torch.dtype
    compute_dtype: torch.dtype
    reduce_dtype: torch.dtype
    offload_params: bool
    blocked_step: bool  # the optimizer steps in blocks: the upcast is one block

    @property
    def upcast_numel(self) -> int:
        """Elements of the step's fp32 upcast: one block, or one shard where the optimizer
        steps whole groups ([Note: blocked host step])."""
        if self.blocked_step:
            return min(STEP_BLOCK, self.staging_numel)
        return self.staging_numel

    @property
    def used_numel(self) -> int:
        """Elements of the chunk space the shards fill (the rest is padding)."""
        return sum(self.shard_numels)

    @property
    def chunk_space_numel(self) -> int:
        """Elements of the chunk space: of the master, the gradient and the compute shards."""
        return self.chunks.num_chunks * self.chunks.shard_numel

    @property
    def masters_are_shards(self) -> bool:
        """With offload_params and masters in the compute dtype, the host's compute shards
        are the masters themselves ([Note: offload upload] in _upload.py)."""
        return self.offload_params and self.master_dtype == self.compute_dtype

    @property
    def grads_held_bytes(self) -> int:
        """The gradients held until `step()`: one per chunk in the reduce dtype (pinned)."""
        return self.chunk_space_numel * self.reduce_dtype.itemsize

    @property
    def staging_bytes(self) -> int:
        """The gradient staging slots (pinned)."""
        return GRAD_STAGING * self.staging_numel * self.reduce_dtype.itemsize

    def pinned_bytes(self, *, grads_held: bool, staged: bool) -> int:
        """Host bytes that are pinned (when pinning succeeds: on a GPU); `grads_held`: with
        the gradients held until `step()` (every way of stepping but `step_in_backward`
        without accumulation); `staged`: with the staging slots (groups stepped as their
        gradients land: `step_in_backward`)."""
        staging = self.staging_bytes if staged else 0
        held = self.grads_held_bytes if grads_held else 0
        # What goes up: the compute shards with offload_params (the masters themselves
        # where they share a dtype), else the masters, cast on the device.
        up = self.compute_dtype if self.offload_params else self.master_dtype
        return staging + held + self.chunk_space_numel * up.itemsize

    def host_bytes(self, *, grads_held: bool, staged: bool) -> int:
        """All host bytes (`grads_held` and `staged` as `pinned_bytes` takes them): the
        pinned ones, the masters that are not, and the step's fp32 upcast (and its cast to
        bf16 masters' dtype)."""
        pageable = self.offload_params and not self.masters_are_shards
        master = self.master_dtype.itemsize
        masters = self.chunk_space_numel * master if pageable else 0
        narrow = 0 if self.master_dtype == torch.float32 else self.upcast_numel * master
        upcast = self.upcast_numel * 4 + narrow
        return masters + upcast + self.pinned_bytes(grads_held=grads_held, staged=staged)

    @property
    def device_bytes(self) -> int:
        """Device bytes of the compute-dtype shards and the staging chunk of masters they
        are cast from (none with offload_params, or where the masters are in the compute
        dtype)."""
        if self.offload_params:
            return 0
        master = self.master_dtype
        stage = 0 if self.compute_dtype == master else self.chunks.shard_numel * master.itemsize
        return self.chunk_space_numel * self.compute_dtype.itemsize + stage


def offload_sizes(
    shard_numels: Sequence[int],
    shard_size: int,
    *,
    chunk_bytes: int,
    master_dtype: torch.dtype,
    compute_dtype: torch.dtype,
    reduce_dtype: torch.dtype,
    offload_params: bool,
    blocked_step: bool,
) -> OffloadSizes:
    """What offloading shards of `shard_numels` elements takes on each of `shard_size` ranks,
    in chunks of about `chunk_bytes` of master per rank."""
    per_rank = max(1, chunk_bytes // master_dtype.itemsize)
    numel = sum(shard_numels)
    return OffloadSizes(
        shard_numels=tuple(shard_numels),
        offsets=tuple(itertools.accumulate(shard_numels, initial=0))[:-1],
        chunks=ChunkLayout.build(numel * shard_size, per_rank * shard_size, shard_size),
        staging_numel=max(shard_numels, default=0),
        master_dtype=master_dtype,
        compute_dtype=compute_dtype,
        reduce_dtype=reduce_dtype,
        offload_params=offload_params,
        blocked_step=blocked_step,
    )


def place_offloaded(
    plan: FlatGroupPlan, cfg: ZeroConfig, shard_size: int, *, blocked_step: bool
) -> tuple[FlatGroupPlan, OffloadSizes | None]:
    """`plan` with the groups `cfg`'s CPU offload takes living on the host
    (`choose_offloaded`), and what the host then allocates on each of `shard_size` ranks
    (None: nothing offloaded); `blocked_step`: the optimizer steps offloaded groups in
    blocks (torch's fused Adam/AdamW: one block's fp32 upcast)."""
    if not cfg.offload.optimizer:
        return plan, None
    groups = plan.groups
    chosen = choose_offloaded(
        [g.layout.shard_numel for g in groups],
        [g.trainable for g in groups],
        cfg.offload.ratio,
        registration_order=cfg.stage == 3,
    )
    if not chosen:  # below ratio 1 with nothing trainable
        return plan, None
    sizes = offload_sizes(
        [groups[i].layout.shard_numel for i in chosen],
        shard_size,
        chunk_bytes=cfg.offload.chunk_bytes,
        master_dtype=cfg.precision.master_dtype,
        compute_dtype=cfg.precision.compute_dtype,
        reduce_dtype=cfg.precision.grad_reduce_dtype,
        offload_params=cfg.offload.params,
        blocked_step=blocked_step,
    )
    return plan.homed({groups[i].index for i in chosen}, HomeKind.HOST), sizes
