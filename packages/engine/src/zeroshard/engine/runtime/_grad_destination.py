"""`GradDestination`: where a flat group's reduced gradient shard goes.

Every flat group is built with one. The reducer hands it each reduced shard, tells it
when backward's reductions are done and when `zero_grad` forgets a gradient, and never
asks where the gradient lives; the optimizer's clipping and gradient scaling (fp16
unscaling, the clip coefficient) read and scale the gradients through it as well.
`DEVICE_GRADS` keeps the shard on the group's device (as `master.grad`, in the master's
dtype); CPU offload's `offload.HostGrads` keeps it on the host. Each group's `Home` holds
its shard ([Note: home and wire] in _home.py).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Protocol

import torch

from zeroshard.engine.runtime._casts import cast_into
from zeroshard.engine.runtime._host_norm import shard_norm

if TYPE_CHECKING:
    from zeroshard.engine.runtime._flat_group import FlatParamGroup


def by_device(tensors: Sequence[torch.Tensor]) -> dict[torch.device, list[torch.Tensor]]:
    """Tensors grouped by device (foreach kernels take one device at a time)."""
    out: dict[torch.device, list[torch.Tensor]] = {}
    for t in tensors:
        out.setdefault(t.device, []).append(t)
    return out


class GradDestination(Protocol):
    """Where the reduced gradient shards of flat groups go, and how they are read back."""

    def reduces_in_place(self, g: FlatParamGroup, reduce_dtype: torch.dtype) -> bool:
        """Whether `g`'s reduce-scatter may write its shard into `g`'s own part of the
        bucket ([Note: in-place reduce-scatter] in _reduce.py)."""
        ...

    def receive(self, g: FlatParamGroup, reduced: torch.Tensor, *, fresh: bool) -> None:
        """Take `reduced` (complete on the current stream) as, or add it into, `g`'s
        gradient; `fresh`: it is new memory nobody else holds."""
        ...

    def drain(self) -> None:
        """Wait until every gradient received so far is in place (end of backward)."""
        ...

    def forget(self, g: FlatParamGroup, *, set_to_none: bool) -> None:
        """zero_grad: `g` holds no gradient of the next window (`set_to_none`: free it)."""
        ...

    def norms(self, groups: Sequence[FlatParamGroup]) -> list[torch.Tensor]:
        """The 2-norm of each group's gradient as the step will see it (every group holds
        one: zeros where none arrived)."""
        ...

    def scale(self, groups: Sequence[FlatParamGroup], factor: torch.Tensor | float) -> None:
        """Multiply the gradients of `groups` by `factor`."""
        ...

    def read(self, g: FlatParamGroup) -> Iterator[tuple[int, torch.Tensor]]:
        """`g`'s gradient as the step will see it (in the master's dtype, every factor
        applied), in pieces: (start in the shard, values), each valid until the next is
        taken; none where `g` holds no gradient (state/_introspect.py reads it)."""
        ...


class DeviceGrads:
    """The gradient shard on the group's device, in the master's dtype, exposed as
    `master.grad`."""

    def reduces_in_place(self, g: FlatParamGroup, reduce_dtype: torch.dtype) -> bool:
        """In place where the shard is only folded into another (added, or cast); a
        window's first shard in the master's dtype becomes the gradient itself, so it
        must be new memory."""
        return g.grad_shard is not None or reduce_dtype != g.master.dtype

    def receive(self, g: FlatParamGroup, reduced: torch.Tensor, *, fresh: bool) -> None:
        """The first gradient since zero_grad: the reduce-scatter's output, fresh and in
        the master's dtype, becomes the shard (no copy of it); another dtype is cast into
        fresh memory, no zero fill ([Note: widening copies] in _casts.py). Later ones add
        into it."""
        if g.grad_shard is None:
            if not (fresh and g.home.adopt_grad_shard(reduced)):
                cast_into(g.home.claim_grad_shard(), reduced)
        else:
            g.grad_shard.add_(reduced)

    def drain(self) -> None:
        """Nothing to wait for: the fold ran on the current stream."""

    def forget(self, g: FlatParamGroup, *, set_to_none: bool) -> None:
        """Free the shard, or zero it in place."""
        if g.grad_shard is None:
            return
        if set_to_none:
            g.home.drop_grad_shard()
        else:
            g.grad_shard.zero_()

    def norms(self, groups: Sequence[FlatParamGroup]) -> list[torch.Tensor]:
        """One norm per shard; CPU shards as offloaded ones are ([Note: host gradient
        norm]): on every core."""
        shards = [g.home.ensure_grad_shard() for g in groups]
        out: list[torch.Tensor] = []
        for device, same in by_device(shards).items():
            out += (
                [shard_norm(s) for s in same] if device.type == "cpu" else torch._foreach_norm(same)
            )
        return out

    def scale(self, groups: Sequence[FlatParamGroup], factor: torch.Tensor | float) -> None:
        """In place, one foreach multiplication per device."""
        shards = [g.home.ensure_grad_shard() for g in groups]
        for device, same in by_device(shards).items():
            f = factor.to(device) if isinstance(factor, torch.Tensor) else factor
            torch._foreach_mul_(same, f)

    def read(self, g: FlatParamGroup) -> Iterator[tuple[int, torch.Tensor]]:
        """The shard itself, in one piece."""
        if g.grad_shard is not None:
            yield 0, g.grad_shard


DEVICE_GRADS = DeviceGrads()


def by_destination(
    groups: Sequence[FlatParamGroup],
) -> list[tuple[GradDestination, list[FlatParamGroup]]]:
    """`groups` by their gradients' destination, `DEVICE_GRADS` first: the order clipping
    adds the norms in, so a norm's bits do not depend on which groups come first."""
    out: dict[int, tuple[GradDestination, list[FlatParamGroup]]] = {
        id(DEVICE_GRADS): (DEVICE_GRADS, [])
    }
    for g in groups:
        out.setdefault(id(g.grads), (g.grads, []))[1].append(g)
    return [(d, gs) for d, gs in out.values() if gs]
