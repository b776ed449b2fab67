"""`GroupHome`: where a flat group keeps its fp32 master shard and its gradient, handed to
`build_flat_group` so the group is complete when built: `DEVICE_HOME` here, or an
offloaded group's part of the host storage (`offload.HostOffload.home`)."""

from __future__ import annotations

from typing import Protocol

import torch

from zeroshard.engine.runtime._gather_source import MASTER_CAST, GatherSource
from zeroshard.engine.runtime._grad_destination import DEVICE_GRADS, GradDestination


class GroupHome(Protocol):
    """Where a flat group keeps its fp32 master shard, sends its reduced gradient and reads
    its gathers from: `DEVICE_HOME`, or an offloaded group's part of the host storage
    (`offload.HostOffload.home`). Given to `build_flat_group`, so the group is complete
    when built."""

    @property
    def grads(self) -> GradDestination:
        """Where the group's reduced gradient shard goes."""
        ...

    @property
    def source(self) -> GatherSource:
        """What the group's gathers send."""
        ...

    @property
    def grad(self) -> torch.Tensor | None:
        """The memory the gradient shard lives in between steps (None: allocated when a
        window's first gradient arrives)."""
        ...

    def master(self, shard: torch.Tensor) -> torch.Tensor:
        """The fp32 master holding `shard` (this rank's part of the flat buffer)."""
        ...


class DeviceHome:
    """The master and its gradient on the group's device; gathers cast the master."""

    grads: GradDestination = DEVICE_GRADS
    source: GatherSource = MASTER_CAST
    grad: torch.Tensor | None = None

    def master(self, shard: torch.Tensor) -> torch.Tensor:
        """A new fp32 copy of `shard`, where it is."""
        return shard.detach().to(torch.float32, copy=True)


DEVICE_HOME = DeviceHome()
