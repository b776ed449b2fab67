"""`Home`: where one flat group's master, gradient shard and compute shard live.

[Note: home and wire]
A flat group's state is chosen on two independent axes when the group is built. Its
*home* (this module) is where its master shard, its gradient shard and the compute shard
its gathers read live: `DeviceHome` here, or an offloaded group's part of the host
storage (`offload.HostHome`). Its *wire* (`_wire.py`) is how that shard travels: cast to
the compute dtype, or to fp8 with a scale per weight. A gather asks the home for this
rank's shard on the device (`compute_shard`) and the wire to write it into the gathered
buffer; neither knows the other, so any home goes with any wire: offload never decides
what travels, and fp8 never decides where state lives.

The home owns the gradient shard's life in a step window: the reducer hands reduced
shards to its `grads` (the `GradDestination` every home of its kind shares), which calls
back `claim_grad_shard` / `adopt_grad_shard` here; clipping reads them through `grads`;
`zero_grad` forgets them. A home of the device exposes its gradient shard as
`master.grad`; a home of the host keeps it in host memory allocated once (on first
need: [Note: offload host memory] in offload/_host_offload.py) and sets `master.grad`
only while the host step steps it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from enum import Enum
from typing import TYPE_CHECKING, Protocol

import torch
from torch import nn

from zeroshard.engine.runtime._grad_destination import DEVICE_GRADS, GradDestination

if TYPE_CHECKING:
    from zeroshard.engine.runtime._flat_group import FlatParamGroup


class HomeKind(Enum):
    """Where a flat group's master and gradient shard live."""

    DEVICE = "device"
    HOST = "host"


class HomeStore(Protocol):
    """What every home of one kind shares: the storage behind them."""

    def refresh(self, groups: Sequence[FlatParamGroup]) -> None:
        """The masters of `groups` changed outside a step (a load, an edit): rewrite what
        their `compute_shard`s read from them."""
        ...


class Home(ABC):
    """One flat group's master shard (`master`, the optimizer's parameter), its gradient
    shard of the current window (`grad_shard`, None when it holds none) and the compute
    shard its gathers read; see [Note: home and wire]."""

    kind: HomeKind

    def __init__(
        self,
        master: nn.Parameter,
        grads: GradDestination,
        store: HomeStore,
    ) -> None:
        self.master = master
        # Where the reduced gradient shards go, and what reads them back.
        self.grads = grads
        self.store = store
        self.grad_shard: torch.Tensor | None = None

    @abstractmethod
    def compute_shard(self) -> torch.Tensor:
        """This rank's shard on the device as a wire reads it (the master, or a compute
        copy of it), ready for the current stream to read."""

    def ensure_grad_shard(self) -> torch.Tensor:
        """The gradient shard, zeroed on first use since the last `zero_grad`."""
        if self.grad_shard is None:
            return self.claim_grad_shard().zero_()
        return self.grad_shard

    def claim_grad_shard(self) -> torch.Tensor:
        """The gradient shard's memory, NOT zeroed: for a caller that overwrites all of it
        (the first reduced gradient since the last `zero_grad`): new memory exposed as
        `master.grad` (a host home's is memory kept between steps instead)."""
        assert self.grad_shard is None
        self.grad_shard = self.master.grad = torch.empty_like(self.master)
        return self.grad_shard

    def adopt_grad_shard(self, reduced: torch.Tensor) -> bool:
        """Make `reduced` (a fresh reduced shard nobody else holds) the gradient shard
        itself, as `master.grad`, instead of copying it into new memory; False where it
        cannot be (another dtype, device or shape; a host home's memory is its own)."""
        assert self.grad_shard is None
        master = self.master
        if (
            reduced.dtype != master.dtype
            or reduced.device != master.device
            or reduced.shape != master.shape
        ):
            return False
        self.grad_shard = master.grad = reduced
        return True

    def take_master_grad(self) -> None:
        """Autograd accumulated this window's gradient into `master.grad` itself (a
        compiled graph reduce-scatters into it): that tensor is the gradient shard."""
        self.grad_shard = self.master.grad

    def drop_grad_shard(self) -> None:
        """Hold no gradient of this window (its memory freed unless kept between steps)."""
        self.grad_shard = self.master.grad = None


class DeviceStore:
    """What device homes share: nothing to rewrite, their gathers read the masters."""

    def refresh(self, groups: Sequence[FlatParamGroup]) -> None:
        """Nothing: the next gathers read the changed masters as they are."""


DEVICE_STORE = DeviceStore()


class DeviceHome(Home):
    """The master and its gradient shard on the group's device; gathers read the master."""

    kind = HomeKind.DEVICE

    def compute_shard(self) -> torch.Tensor:
        """The master itself (the wire casts it)."""
        return self.master.detach()


class DeviceHomes:
    """Builds device homes with masters in `master_dtype` (fp32, or
    `precision.master_dtype`)."""

    def __init__(self, master_dtype: torch.dtype = torch.float32) -> None:
        self.master_dtype = master_dtype

    def build(self, index: int, shard: torch.Tensor, requires_grad: bool) -> DeviceHome:
        """The home of flat group `index`: a copy of `shard` (this rank's part of its flat
        buffer, on the device) as its master."""
        master = shard.detach().to(self.master_dtype, copy=True)
        return DeviceHome(nn.Parameter(master, requires_grad), DEVICE_GRADS, DEVICE_STORE)


class HomeBuilder(Protocol):
    """Builds the home of a flat group from its shard (`DeviceHomes`, `offload.HostOffload`)."""

    def build(self, index: int, shard: torch.Tensor, requires_grad: bool) -> Home:
        """The home of flat group `index`, holding `shard`'s values as its master."""
        ...


def refresh_homes(groups: Sequence[FlatParamGroup]) -> None:
    """The masters of `groups` changed outside a step: each store rewrites what its
    homes' `compute_shard`s read (in first-seen order of the stores)."""
    by_store: dict[int, tuple[HomeStore, list[FlatParamGroup]]] = {}
    for g in groups:
        by_store.setdefault(id(g.home.store), (g.home.store, []))[1].append(g)
    for store, same in by_store.values():
        store.refresh(same)
