"""`GroupHome`: where a flat group keeps its master shard and its gradient, handed to
`build_flat_group` so the group is complete when built: a `DeviceHome` here, or an
offloaded group's part of the host storage (`offload.HostOffload.home`)."""

from __future__ import annotations

from typing import Protocol

import torch

from zeroshard.engine.runtime._gather_source import MASTER_CAST, GatherSource
from zeroshard.engine.runtime._grad_destination import DEVICE_GRADS, GradDestination


class GroupHome(Protocol):
    """Where a flat group keeps its master shard, sends its reduced gradient and reads
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
        """The master holding `shard` (this rank's part of the flat buffer)."""
        ...


class DeviceHome:
    """The master and its gradient on the group's device, in `master_dtype` (fp32, or
    `precision.master_dtype`); gathers cast the master."""

    grads: GradDestination = DEVICE_GRADS
    source: GatherSource = MASTER_CAST
    grad: torch.Tensor | None = None

    def __init__(self, master_dtype: torch.dtype = torch.float32) -> None:
        self.master_dtype = master_dtype

    def master(self, shard: torch.Tensor) -> torch.Tensor:
        """A new copy of `shard` in the master dtype, where it is."""
        return shard.detach().to(self.master_dtype, copy=True)


DEVICE_HOME = DeviceHome()
"""fp32 masters on the device: the default."""
