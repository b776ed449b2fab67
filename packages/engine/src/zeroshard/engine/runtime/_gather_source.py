"""`GatherSource`: what a flat group's all-gather sends, and how the gathered buffer is
filled. Every flat group is built with one: `MASTER_CAST` here, CPU offload's
`offload.HostOffload`, which keeps a compute shard of its own, or `Float8Gather`
(`_float8_gather.py`), which gathers torchao's fp8 weights in fp8."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

import torch

from zeroshard.comm import Handle

if TYPE_CHECKING:
    from zeroshard.engine.runtime._flat_group import FlatParamGroup


class GatherSource(Protocol):
    """What a flat group's all-gather sends and how its gathered buffer is filled: the
    master cast to the compute dtype (`MASTER_CAST`), or the compute shard CPU offload
    keeps on the device (`offload.HostOffload`), or fp8 with a scale per weight
    (`Float8Gather`). Stage 3's gathers and stages 1/2's publish both go through it."""

    def gathered_dtype(self, compute_dtype: torch.dtype) -> torch.dtype:
        """The dtype of the gathered buffer of a stage-3 group computing in `compute_dtype`.
        Where it is not the compute dtype the parameters cannot be views of the buffer:
        the source hands forward its own tensors (`Float8Gather`)."""
        ...

    def start_gather(self, g: FlatParamGroup, buffer: torch.Tensor, *, label: str) -> Handle:
        """Start gathering every rank's shard of `g` into `buffer` (its flat buffer of
        `gathered_dtype`, storage allocated); `buffer` holds them once the handle was
        waited."""
        ...

    def refresh(self, groups: Sequence[FlatParamGroup]) -> None:
        """The masters of `groups` changed outside a step (a load, an edit): make what the
        next gathers send from them (collective where the source needs one)."""
        ...

    def after_step(self, groups: Sequence[FlatParamGroup]) -> None:
        """The masters of `groups` were just stepped (and what the step itself rewrites,
        offload's compute shards, is rewritten): make what the next gathers send from them
        (collective where the source needs one)."""
        ...


def gather_in_place(
    g: FlatParamGroup, buffer: torch.Tensor, shard: torch.Tensor, *, label: str
) -> Handle:
    """[Note: in-place gather] This rank's `shard` (in `buffer`'s dtype, or cast to it) is
    copied straight into its part of `buffer`, and the all-gather runs in place (its input
    is that part, as FSDP2's): no send buffer is allocated, and the collective does not
    copy this rank's own part again (NCCL skips it in place; with one rank nothing is left
    to move). The copy is ordered before the collective on the current stream."""
    lo, hi = g.shard_range
    mine = buffer[lo:hi]
    mine.copy_(shard)
    return g.process_group.all_gather_into(buffer, mine, label=label)


class MasterCast:
    """Gathers send the fp32 master cast to the compute dtype: the cast writes this rank's
    part of the buffer, so only compute-dtype bytes travel."""

    def gathered_dtype(self, compute_dtype: torch.dtype) -> torch.dtype:
        """The compute dtype: the parameters are views of the gathered buffer."""
        return compute_dtype

    def start_gather(self, g: FlatParamGroup, buffer: torch.Tensor, *, label: str) -> Handle:
        """Cast the master into `buffer` and gather in place."""
        return gather_in_place(g, buffer, g.master.detach(), label=label)

    def refresh(self, groups: Sequence[FlatParamGroup]) -> None:
        """Nothing: every gather casts the master as it is."""

    def after_step(self, groups: Sequence[FlatParamGroup]) -> None:
        """Nothing: every gather casts the master as it is."""


MASTER_CAST = MasterCast()
