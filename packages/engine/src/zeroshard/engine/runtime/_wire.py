"""`Wire`: how one flat group's shard travels ([Note: home and wire] in _home.py).

A gather writes this rank's part of the gathered buffer through the group's wire
(`encode_into`, reading the home's `compute_shard`) and all-gathers in place
([Note: in-place gather] in _collectives.py). `ComputeCast` here casts to the compute
dtype: the parameters are views of the gathered buffer. `Float8Wire`
(`_float8_gather.py`) casts torchao's fp8 weights to fp8, each with its scale: the buffer
holds fp8, and forward reads each weight through its module's hooks. Stages 1 and 2
publish their stepped shards through the same wire.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from enum import Enum
from typing import TYPE_CHECKING, Protocol

import torch
from torch import nn

from zeroshard.partition import FlatLayout

if TYPE_CHECKING:
    from zeroshard.engine.runtime._flat_group import FlatParamGroup


class WireKind(Enum):
    """How a flat group's shard travels."""

    COMPUTE = "compute"  # cast to the compute dtype
    FLOAT8 = "float8"  # torchao's fp8 weights, in fp8 with a scale per weight


class WireStore(Protocol):
    """What every wire of one kind shares (fp8's scales, taken in one collective)."""

    def refresh(self, groups: Sequence[FlatParamGroup]) -> None:
        """The masters of `groups` changed (a step, a load): make what their next gathers
        send follow (collective where the wire needs one, in `groups`' order)."""
        ...


class Wire(ABC):
    """How one flat group's shard travels: `dtype` is what the gathered buffer holds."""

    kind: WireKind
    dtype: torch.dtype
    store: WireStore

    @abstractmethod
    def encode_into(self, out: torch.Tensor, shard: torch.Tensor) -> None:
        """Write `shard` (this rank's, from its home's `compute_shard`) into `out`, its
        part of the gathered buffer."""


class WireBuilder(Protocol):
    """Builds the wires of one kind (`ComputeCasts`, `Float8Wires`)."""

    @property
    def dtype(self) -> torch.dtype:
        """What the gathered buffers of its wires hold."""
        ...

    def build(
        self,
        params: Sequence[nn.Parameter],
        layout: FlatLayout,
        shard_range: tuple[int, int],
        slots: Sequence[torch.Tensor],
    ) -> Wire:
        """The wire of a flat group of `params` laid out as `layout` (this rank holding
        `shard_range`), whose gathered buffer's slot views are `slots` (stage 3; empty at
        stages 1/2, whose buffer is the parameters' own)."""
        ...


class NothingToRefresh:
    """The store of wires that read the masters as they are at every gather."""

    def refresh(self, groups: Sequence[FlatParamGroup]) -> None:
        """Nothing: every gather casts what the home holds then."""


NOTHING_TO_REFRESH = NothingToRefresh()


class ComputeCast(Wire):
    """The shard cast to the compute dtype as it is written into the buffer: only
    compute-dtype bytes travel."""

    kind = WireKind.COMPUTE
    store: WireStore = NOTHING_TO_REFRESH

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype

    def encode_into(self, out: torch.Tensor, shard: torch.Tensor) -> None:
        """Copy `shard` into `out`, cast to `out`'s dtype."""
        out.copy_(shard)


class ComputeCasts:
    """Builds `ComputeCast` wires to `dtype` (the compute dtype)."""

    def __init__(self, dtype: torch.dtype) -> None:
        self._dtype = dtype

    @property
    def dtype(self) -> torch.dtype:
        """The compute dtype: the parameters are views of the gathered buffer."""
        return self._dtype

    def build(
        self,
        params: Sequence[nn.Parameter],
        layout: FlatLayout,
        shard_range: tuple[int, int],
        slots: Sequence[torch.Tensor],
    ) -> ComputeCast:
        """A cast to the compute dtype (it needs nothing of the group)."""
        return ComputeCast(self._dtype)


def refresh_wires(groups: Sequence[FlatParamGroup]) -> None:
    """The masters of `groups` changed (a step, a load, the first build): each store makes
    what its wires send follow (collective where one needs it; the same order on every
    rank: `groups`', by first-seen store)."""
    by_store: dict[int, tuple[WireStore, list[FlatParamGroup]]] = {}
    for g in groups:
        by_store.setdefault(id(g.wire.store), (g.wire.store, []))[1].append(g)
    for store, same in by_store.values():
        store.refresh(same)
