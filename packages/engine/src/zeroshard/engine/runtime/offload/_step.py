"""The optimizer step of offloaded groups: one group at a time, uploading as it goes.

[Note: offload step pipeline]
The wrapped optimizer first steps the groups that stay on the device (the offloaded
masters have no `.grad` yet, so it skips them). Then, in chunk-space order, each
offloaded group is stepped alone. With torch's fused Adam/AdamW that is one pass over
the group in cache-sized blocks: upcast a block's gradient, step it, hand its master to
the upload ([Note: blocked host step] in _fused_adam.py). Otherwise the group gets its
whole fp32 gradient as `master.grad` (upcast from the reduce dtype into one group's
buffer: [Note: offload host memory] in _host_offload.py), is stepped by the optimizer, drops
it, and is handed to the upload after. Every chunk whose masters are all final goes up to
the device on the H2D stream while the CPU steps the next groups ([Note: offload stream
order]). The step thus takes about max(CPU step, upload) rather than their sum, and the
host never holds more than one group's fp32 gradient (one block's with the fused kernel).
Under `step_in_backward` each group is stepped this way as its gradient lands, on a
thread of its own: the thread that lands the gradients must stay free, or backward would
wait on the optimizer (a gradient's receive waits for the oldest copy to land).
With several optimizers each group is stepped by the one that owns it (`Owned`), every
optimizer's offloaded groups in one upload round (a chunk may hold groups of several);
their user hooks run once each around the whole step.

Stepping a group alone gives the same bits as one step over all of them only for an
optimizer that updates each element from that element's own state, gradient and
hyperparameters: torch's built-in per-parameter optimizers (`_PER_ELEMENT`; each keeps
its `step` count per parameter). Any other optimizer gets one step over every group,
with every offloaded gradient upcast at once (4 more bytes per element for that step),
and the upload after it.

The user's step hooks on the wrapped optimizer run once around the whole step, as they
would around one `step()`: the per-group calls go to the class's unhooked `step`.

[Note: delayed parameter update]
With `offload.delay_param_update` (ZeRO-Offload's DPU) `step()` k steps the groups left on
the device at once, then hands the offloaded groups to the stepping thread (`DelayedStep`)
and returns: their CPU step, and the upload of their compute shards as each chunk is
final, run while the forward and backward of window k+1 compute with the parameters
published at step() k, the weights of step k-1. Step() k+1 waits for step k (`settle`),
publishes its weights (the device groups' too, so every weight lags alike), and only then
starts step k+1. So g_k is computed at w_{k-2} (w_{-1} = w_0) and w_k = step(w_{k-1}, g_k):
the step time tends to max(GPU forward + backward, CPU step) instead of their sum.

What the thread reads is fixed at step(): each group's gradient and pending factors
(`HostGrad`: `zero_grad` forgets them at once) and the fused kernel's hyperparameters
(`FusedAdam`, a tensor lr copied: an LR scheduler changes them after step()). Only torch's
fused Adam/AdamW step this way (`delayed_step_refusal`): any other optimizer reads its
param groups while it steps. Several such optimizers step their own groups in one delayed
step (one upload round, one order of arrival). A whole-matrix optimizer beside them (Muon)
steps its groups at step() on the main thread, its exchange being a collective ([Note:
whole-matrix steps are collectives] in whole/_exchange.py), before the delayed step starts
(its homes' upload round closed first); its masters are published with the others at
step() k+1, so its weights lag alike, and only its step does not overlap the window.

The thread steps the groups in the order their gradients arrived in the backward before:
the next backward's come in the same order, and a gradient lands in the host gradient its
group's step still reads only after that step finished (`HostOffload.receive` waits for
it), so no second host gradient is held (0 more host bytes per parameter) and backward
waits on the CPU only where the CPU is slower.
Gradient accumulation and stage 1's reduction at the step land in the same buffers
after the same wait. The order is the reducer's, not the groups' index order: stepped
highest index first, the next backward's first gradient would wait for almost the whole
step, nearly every gradient arriving after the step's last group (docs/benchmarks.md,
design-measurements).

The masters and the optimizer state are those of step k only once it finished: clipping
(its upcasts share the step's scratch), `state_dict`, checkpoints, loads,
`full_state_dict` and `gathered_parameters` call `ZeroOptimizer.settle` first. None of
them publishes: the parameters stay one step behind until the next `step()`, so saving
does not change what training computes. A load publishes what it loaded, so a resumed
run computes its first window at the saved weights, without the lag; a snapshot keeps
the lag ([Note: a snapshot of a lagging run] in recovery/_contents.py).

On a GPU the uploads wait on the current stream as of `begin_upload`, at step()
([Note: upload stream order] in _upload.py): that covers the publish that reads
the compute shards, queued at step() before the thread started, so no upload overwrites
a shard it still reads; the next forward and backward, queued later, read the parameters
(stages 1/2), not the compute shards, so the uploads and the slots they free need not
wait for that compute.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Callable, Iterator, Sequence
from itertools import chain
from typing import Any, NamedTuple

import torch
from torch.optim.optimizer import _global_optimizer_post_hooks, _global_optimizer_pre_hooks

from zeroshard.engine.runtime._flat_group import FlatParamGroup
from zeroshard.engine.runtime.offload._fused_adam import FusedAdam, fused_adam, steps_in_blocks
from zeroshard.engine.runtime.offload._host_grads import HostGrad
from zeroshard.engine.runtime.offload._host_offload import HostOffload

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
def _only(inner: torch.optim.Optimizer, masters: Sequence[torch.Tensor]) -> Iterator[None]:
    """Within the block `inner` holds only `masters` (each in its own param group), so a
    step steps them alone whatever other masters hold gradients."""
    keep = {id(m) for m in masters}
    saved = [pg["params"] for pg in inner.param_groups]
    for pg in inner.param_groups:
        pg["params"] = [m for m in pg["params"] if id(m) in keep]
    try:
        yield
    finally:
        for pg, params in zip(inner.param_groups, saved, strict=True):
            pg["params"] = params


@contextlib.contextmanager
def _step_hooks(inner: torch.optim.Optimizer) -> Iterator[None]:
    """Run `inner`'s step pre- and post-hooks once around the block, as `step()` does."""
    args: tuple[Any, ...] = (inner,)
    kwargs: dict[str, Any] = {}
    pre_hooks = chain(
        _global_optimizer_pre_hooks.values(), inner._optimizer_step_pre_hooks.values()
    )
    for pre in pre_hooks:
        if pre(inner, args, kwargs) is not None:
            raise RuntimeError("zeroshard offload: optimizer step pre-hooks must return None")
    yield
    inner._optimizer_step_code()
    post_hooks = chain(
        inner._optimizer_step_post_hooks.values(), _global_optimizer_post_hooks.values()
    )
    for post in post_hooks:
        post(inner, args, kwargs)


def param_group_of(inner: torch.optim.Optimizer, g: FlatParamGroup) -> int:
    """The index of `inner`'s param group that steps `g`'s master (`inner` is one of
    several optimizers, whose param groups `GroupKey.param_group` counts together)."""
    master = g.master
    for k, pg in enumerate(inner.param_groups):
        if any(p is master for p in pg["params"]):
            return k
    raise ValueError(
        f"flat group {g.index}'s master is in no param group of {type(inner).__name__}"
    )


def _step_masters(
    step: Callable[[], Any], inner: torch.optim.Optimizer, masters: Sequence[torch.Tensor]
) -> None:
    """Step `masters` (those with a gradient) alone."""
    if any(m.grad is not None for m in masters):
        with _only(inner, masters):
            step()


def _step_blocked(
    adam: FusedAdam,
    inner: torch.optim.Optimizer,
    offload: HostOffload,
    g: FlatParamGroup,
    grad: HostGrad,
) -> None:
    """[Note: blocked host step]: upcast, step and downcast `g` one block at a time (no
    autograd: this may run on the stepping thread, where grad mode is on)."""
    with torch.no_grad():
        offload.step_blocked(g, adam, adam.begin(inner, g.master), grad)


def _step_group(
    step: Callable[[], Any], inner: torch.optim.Optimizer, offload: HostOffload, g: FlatParamGroup
) -> None:
    """Step `g`'s master alone on its fp32 gradient, casting it for the upload as it goes."""
    host = offload.grads.host_grad(g)
    adam = fused_adam(inner, param_group_of(inner, g)) if host is not None else None
    if adam is not None and host is not None:
        _step_blocked(adam, inner, offload, g, host)
        return
    grad = offload.grads.grad_fp32(g)
    if grad is not None:
        # bf16 masters step on the upcast cast back into their scratch.
        narrow = offload.grads.narrow
        if narrow is not None:
            grad = narrow[: grad.numel()].view_as(grad).copy_(grad)
        g.master.grad = grad
        _step_masters(step, inner, [g.master])
        g.master.grad = None
    offload.stepped(g)


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
            grad = offload.grads.grad_fp32(g)
            # Every group at once: a copy of each upcast (the buffer holds one group's).
            if grad is not None and (grad is not g.grad_shard or grad.dtype != g.master.dtype):
                grad = grad.to(g.master.dtype, copy=True)
            g.master.grad = grad
        inner.step()
        for g in on_host:
            g.master.grad = None
        offload.refresh(on_host)
        return
    with _step_hooks(inner):
        _step_masters(step, inner, [g.master for g in on_device])
        offload.begin_upload(on_host)
        for g in on_host:
            _step_group(step, inner, offload, g)
        offload.finish_upload()


class Owned(NamedTuple):
    """One optimizer of those CPU offload steps and its trainable flat groups, on the
    device and on the host (each steps its own groups: [Note: offload step pipeline])."""

    inner: torch.optim.Optimizer
    on_device: Sequence[FlatParamGroup]
    on_host: Sequence[FlatParamGroup]


def _on_host(owned: Sequence[Owned]) -> list[FlatParamGroup]:
    """Every optimizer's offloaded groups: the groups of one upload round."""
    return [g for o in owned for g in o.on_host]


class EarlyStep:
    """The step of one backward's offloaded groups, each as its gradient lands on the host
    (`ZeroOptimizer.step_in_backward`) and with the optimizer that owns it; `finish` steps
    the rest at `step()`."""

    def __init__(self, owned: Sequence[Owned], offload: HostOffload) -> None:
        steps = []
        for o in owned:
            step = _unhooked_step(o.inner)
            if step is None:
                raise ValueError(
                    f"step_in_backward steps one group at a time: {type(o.inner).__name__} is "
                    "not one of torch's per-element optimizers "
                    f"({', '.join(t.__name__ for t in _PER_ELEMENT)})"
                )
            steps.append(step)
        self.owned, self.offload, self.steps = owned, offload, steps
        self._hooks = contextlib.ExitStack()
        # The user's step hooks: pre now (before the first group steps), post in `finish`.
        for o in owned:
            self._hooks.enter_context(_step_hooks(o.inner))
        # One upload round for every optimizer's groups: a chunk may hold several's.
        offload.begin_upload(_on_host(owned))
        # Another stepper's groups land too (Muon's, stepped at step(): held till then).
        offload.step_thread.step_each(
            {
                g.index: functools.partial(_step_group, step, o.inner, offload, g)
                for o, step in zip(owned, steps, strict=True)
                for g in o.on_host
            }
        )

    def finish(self) -> None:
        """After the backward (its gradients and steps drained): the device groups, the
        chunks not sent yet, the post-hooks."""
        self.offload.step_thread.step_each(None)
        for o, step in zip(self.owned, self.steps, strict=True):
            _step_masters(step, o.inner, [g.master for g in o.on_device])
        self.offload.finish_upload()
        self._hooks.close()


class DelayedStep:
    """The step of one window's offloaded groups, each with the optimizer that owns it,
    run on the stepping thread while the next window's forward and backward compute
    (delay_param_update: [Note: delayed parameter update]); `wait` waits for it."""

    def __init__(self, owned: Sequence[Owned], offload: HostOffload) -> None:
        # What the thread reads is taken now: an LR scheduler may change the param groups
        # and `zero_grad` forget the gradients before the thread gets to a group.
        work: dict[int, tuple[torch.optim.Optimizer, FusedAdam, HostGrad]] = {}
        steps = []
        for o in owned:
            why = delayed_step_refusal(o.inner)
            if why:
                raise ValueError(why)
            step = _unhooked_step(o.inner)
            assert step is not None
            steps.append(step)
            for g in o.on_host:
                adam = fused_adam(o.inner, param_group_of(o.inner, g))
                grad = offload.grads.host_grad(g)
                if adam is None or grad is None:
                    continue
                if isinstance(adam.lr, torch.Tensor):
                    adam = dataclasses.replace(adam, lr=adam.lr.clone())
                work[g.index] = (o.inner, adam, grad)
        self.offload = offload
        self._hooks = contextlib.ExitStack()
        # The user's step hooks: pre now, post in `wait` (on this thread, not the stepper).
        for o in owned:
            self._hooks.enter_context(_step_hooks(o.inner))
        for o, step in zip(owned, steps, strict=True):
            _step_masters(step, o.inner, [g.master for g in o.on_device])
        on_host = _on_host(owned)
        offload.begin_upload(on_host)

        def step_one(g: FlatParamGroup) -> None:
            if g.index in work:
                inner, adam, grad = work[g.index]
                _step_blocked(adam, inner, offload, g, grad)
            else:
                offload.stepped(g)

        # In the order the gradients arrived ([Note: delayed parameter update]).
        offload.step_thread.step_delayed(on_host, step_one, then=offload.finish_upload)

    def wait(self) -> None:
        """Wait until every group was stepped and uploaded, then run the post-hooks (not
        after an error, as around a `step()` that raised)."""
        with self._hooks:
            self.offload.step_thread.settle()


def delayed_step_refusal(inner: torch.optim.Optimizer) -> str:
    """Why delay_param_update cannot step with `inner`, or "" where it can."""
    what = "offload.delay_param_update steps on a thread with the hyperparameters its step() saw"
    return blocked_step_refusal(inner, what)


def blocked_step_refusal(inner: torch.optim.Optimizer, what: str) -> str:
    """Why an option that needs the blocked step ([Note: blocked host step]) cannot step
    with `inner` (`what` says what the option does), or "" where it can."""
    blocked = type(inner) in _PER_ELEMENT and steps_in_blocks(inner)
    if blocked:
        return ""
    return (
        f"{what}: it needs torch's Adam or AdamW built with fused=True (not capturable, "
        f"differentiable or with tensor betas), got {type(inner).__name__}"
    )
