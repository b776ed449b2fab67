"""The optimizer step of offloaded groups: one group at a time, uploading as it goes.

[Note: offload step pipeline]
The wrapped optimizer first steps the groups that stay on the device (the offloaded
masters have no `.grad` yet, so it skips them). Then, in chunk-space order, each
offloaded group gets its fp32 gradient as `master.grad` (upcast from the reduce dtype
into one group's buffer: [Note: offload host memory] in _offload.py), is stepped alone,
and drops it; every chunk whose groups are all stepped goes up to the device on the H2D
stream while the CPU steps the next groups ([Note: offload stream order]). The step thus
takes about max(CPU step, upload) rather than their sum, and the host never holds more
than one group's fp32 gradient.

Stepping a group alone gives the same bits as one step over all of them only for an
optimizer that updates each element from that element's own state, gradient and
hyperparameters: torch's built-in per-parameter optimizers (`_PER_ELEMENT`; each keeps
its `step` count per parameter). Any other optimizer gets one step over every group,
with every offloaded gradient upcast at once (4 more bytes per element for that step),
and the upload after it.

The user's step hooks on the wrapped optimizer run once around the whole step, as they
would around one `step()`: the per-group calls go to the class's unhooked `step`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from itertools import chain
from typing import Any

import torch
from torch.optim.optimizer import _global_optimizer_post_hooks, _global_optimizer_pre_hooks

from zeroshard.engine.runtime._flat_group import FlatParamGroup
from zeroshard.engine.runtime._offload import HostOffload

_PER_ELEMENT: tuple[type[torch.optim.Optimizer], ...] = (
    torch.optim.Adam,
    torch.optim.AdamW,
    torch.optim.Adamax,
    torch.optim.NAdam,
    torch.optim.RAdam,
    torch.optim.Adagrad,
    torch.optim.Adadelta,
    torch.optim.RMSprop,
    torch.optim.SGD,
)


def _unhooked_step(inner: torch.optim.Optimizer) -> Callable[[], Any] | None:
    """`inner`'s step without its hooks, or None where the pipeline does not apply."""
    if type(inner) not in _PER_ELEMENT:
        return None
    fn = getattr(type(inner).step, "__wrapped__", None)
    if fn is None:
        return None
    return lambda: fn(inner)


@contextlib.contextmanager
def _step_hooks(inner: torch.optim.Optimizer) -> Iterator[None]:
    """Run `inner`'s step pre- and post-hooks once around the block, as `step()` does."""
    args: tuple[Any, ...] = (inner,)
    kwargs: dict[str, Any] = {}
    for pre in chain(
        _global_optimizer_pre_hooks.values(), inner._optimizer_step_pre_hooks.values()
    ):
        if pre(inner, args, kwargs) is not None:
            raise RuntimeError("zeroshard offload: optimizer step pre-hooks must return None")
    yield
    inner._optimizer_step_code()
    for post in chain(
        inner._optimizer_step_post_hooks.values(), _global_optimizer_post_hooks.values()
    ):
        post(inner, args, kwargs)


def step_offloaded(
    inner: torch.optim.Optimizer,
    offload: HostOffload,
    on_device: Sequence[FlatParamGroup],
    on_host: Sequence[FlatParamGroup],
) -> None:
    """Step every trainable master and upload the offloaded ones ([Note: offload step
    pipeline])."""
    step = _unhooked_step(inner)
    if step is None:
        for g in on_host:
            grad = offload.grad_fp32(g)
            # Every group at once: a copy of each upcast (the buffer holds one group's).
            if grad is not None and grad is not g.grad_shard:
                grad = grad.clone()
            g.master.grad = grad
        inner.step()
        for g in on_host:
            g.master.grad = None
        offload.refresh(on_host)
        return
    with _step_hooks(inner):
        step()
        # The device groups are stepped: hide their gradients from the per-group steps.
        kept = [(g, g.master.grad) for g in on_device]
        for g, _ in kept:
            g.master.grad = None
        offload.begin_upload(on_host)
        for g in on_host:
            grad = offload.grad_fp32(g)
            if grad is not None:
                g.master.grad = grad
                step()
                g.master.grad = None
            offload.upload_through(g)
        offload.finish_upload()
        for g, grad in kept:
            g.master.grad = grad
