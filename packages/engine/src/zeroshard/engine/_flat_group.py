"""`FlatParamGroup`: parameters flattened into one buffer, with this rank's fp32 master shard.

Stages 1 and 2 keep every parameter whole on every rank, as views of `param_buffer`
(compute dtype); each rank owns one even shard of the fp32 master weights and of the
fp32 gradient. The optimizer steps the master shards; the updated shards are cast to the
compute dtype and all-gathered back into `param_buffer`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from zeroshard.comm import Group, Handle
from zeroshard.partition import FlatLayout, FlattenTier, GroupKey, flatten_params

log = logging.getLogger("zeroshard.engine")


@dataclass(eq=False)
class FlatParamGroup:
    """One flat group. `names[i]` is the canonical name of `params[i]`."""

    index: int
    key: GroupKey
    names: tuple[str, ...]
    params: tuple[nn.Parameter, ...]
    layout: FlatLayout
    group: Group
    param_buffer: torch.Tensor
    master: torch.Tensor
    tier: FlattenTier
    grad_shard: torch.Tensor | None = None
    # Stage 1 only: the full gradient, in the compute dtype; `params[i].grad` are views.
    grad_buffer: torch.Tensor | None = None
    slot_views: list[torch.Tensor] = field(default_factory=list)

    @property
    def trainable(self) -> bool:
        """Whether this group's parameters take gradients."""
        return self.key.requires_grad

    @property
    def shard_range(self) -> tuple[int, int]:
        """This rank's [start, end) in the flat buffer."""
        return self.layout.shard_range(self.group.rank)

    def ensure_grad_shard(self) -> torch.Tensor:
        """The fp32 gradient shard, allocated (zeroed) on first use and exposed as `master.grad`."""
        if self.grad_shard is None:
            self.grad_shard = torch.zeros_like(self.master)
            self.master.grad = self.grad_shard
        return self.grad_shard

    def all_gather_params(self) -> Handle:
        """Start the all-gather of the updated master shard into `param_buffer`.

        The cast to the compute dtype happens before the gather, so only compute-dtype
        bytes travel; `send` is kept alive by the handle until `wait()`.
        """
        send = self.master.detach().to(self.param_buffer.dtype)
        return self.group.all_gather_into(
            self.param_buffer, send, label=f"params of group {self.index}"
        )


def slot_views(buffer: torch.Tensor, layout: FlatLayout) -> list[torch.Tensor]:
    """Views of `buffer` shaped like each slot; the buffer may be of any dtype (offsets
    count elements, so a compute-dtype or gradient buffer shares the layout)."""
    return [buffer[s.offset : s.end].view(s.shape) for s in layout.slots]


def build_flat_group(
    index: int,
    key: GroupKey,
    named: Sequence[tuple[str, nn.Parameter]],
    *,
    group: Group,
    compute_dtype: torch.dtype,
    tier: FlattenTier,
    keep_grad_buffer: bool,
) -> FlatParamGroup:
    """Flatten `named` (one GroupKey) and carve this rank's fp32 master shard out of it."""
    for name, p in named:
        if not p.is_floating_point():
            raise ValueError(
                f"parameter {name!r} has dtype {p.dtype}; only floating point is sharded"
            )
        if p.device != group.device:
            raise ValueError(
                f"parameter {name!r} is on {p.device} but the process group works on "
                f"{group.device}; move the model there before initialize()"
            )
    alignment = max(1, 16 // compute_dtype.itemsize)
    layout = FlatLayout.build(
        [(n, tuple(p.shape)) for n, p in named], key.dtype, group.size, alignment
    )
    params = tuple(p for _, p in named)
    start = time.perf_counter()
    flat, used = flatten_params(
        params, layout, device=group.device, tier=tier, group=group if group.size > 1 else None
    )
    lo, hi = layout.shard_range(group.rank)
    master = flat[lo:hi].detach().to(torch.float32, copy=True)
    # The master is an optimizer "parameter": a leaf whose .grad is the gradient shard.
    master = nn.Parameter(master, requires_grad=key.requires_grad)
    param_buffer = flat if compute_dtype == flat.dtype else flat.to(compute_dtype)
    del flat  # the full-precision copy is no longer needed once master and params exist
    views = slot_views(param_buffer, layout)
    for p, v in zip(params, views, strict=True):
        p.data = v
    log.debug(
        "group %d: %d params, %d elements, flattened on tier %s in %.3fs",
        index,
        len(params),
        layout.numel,
        used.value,
        time.perf_counter() - start,
    )
    fg = FlatParamGroup(
        index,
        key,
        tuple(n for n, _ in named),
        params,
        layout,
        group,
        param_buffer,
        master,
        used,
        slot_views=views,
    )
    if keep_grad_buffer and key.requires_grad:
        fg.grad_buffer = torch.zeros_like(param_buffer)
        for p, g in zip(params, slot_views(fg.grad_buffer, layout), strict=True):
            p.grad = g
    return fg
