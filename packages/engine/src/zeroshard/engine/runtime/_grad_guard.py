"""Guard the parameters' `.grad` slots so torch's `clip_grad_norm_` cannot silently do nothing.

[Note: the gradient guard]
The engine keeps gradients as reduced fp32 shards (`optimizer.clip_grad_norm_` clips
those); a parameter's own `.grad` holds either nothing (stages 2/3 free the full gradient
once it is in a reduce bucket) or this rank's unreduced gradient (stage 1). Read through
`torch.nn.utils.clip_grad_norm_(model.parameters(), ...)`, that gives a norm of 0 and no
clipping (stages 2/3) or a rank-local norm (stage 1), silently.

So once a gradient is in the engine's hands, the slot gets a `GradGuard`: a tensor of the
parameter's shape with no storage, whose every operation raises an error that names the
call to use. Only `zero_()` (`model.zero_grad(set_to_none=False)`) and `detach()` pass.
A pre-accumulate hook empties the slot before autograd accumulates the next gradient
(stages 2/3: `None`; stage 1: the view of the gradient buffer it accumulates into), so
accumulation over several backwards and `model.zero_grad()` behave as before.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from zeroshard.engine.runtime._flat_group import FlatParamGroup, slot_views
from zeroshard.engine.runtime._tensor_parallel import is_dtensor, like_param, local_grad

GUIDANCE = (
    "zeroshard keeps gradients as reduced fp32 shards, not in parameter.grad; to clip by "
    "the global norm call optimizer.clip_grad_norm_(max_norm) (it returns the norm), not "
    "torch.nn.utils.clip_grad_norm_(model.parameters(), ...); to read a gradient, "
    "zeroshard.engine.full_grad(model, param), and every one's norm, grad_norms(model)"
)


class GradGuard(torch.Tensor):
    """A storage-less stand-in for a gradient the engine holds as a shard; see the Note."""

    @staticmethod
    def __new__(cls, shape: torch.Size, dtype: torch.dtype, device: torch.device) -> GradGuard:
        return torch.Tensor._make_wrapper_subclass(
            cls, shape, dtype=dtype, device=device, requires_grad=False
        )

    def __repr__(self) -> str:  # type: ignore[override]
        return f"GradGuard(shape={tuple(self.shape)}: {GUIDANCE})"

    @classmethod
    def __torch_dispatch__(  # type: ignore[override]
        cls,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        # `model.zero_grad(set_to_none=False)` zeroes the slot; autograd may detach it.
        if func is torch.ops.aten.zero_.default:
            return args[0]
        if func is torch.ops.aten.detach.default:
            return GradGuard(args[0].shape, args[0].dtype, args[0].device)
        if func is torch.ops.aten._to_copy.default:
            # nn.Module._apply converts each parameter's .grad with its data.
            raise RuntimeError(
                "the model was converted (model.half(), .to(dtype) or .to(device)) after "
                "zeroshard.engine.initialize(): the engine computes in the dtype its config "
                "names, on the device it was built on, and publishes into the buffers it "
                "built then. Set precision.compute_dtype (compute_dtype) instead, and convert "
                "or move the model before initialize(), if at all"
            )
        raise RuntimeError(f"parameter.grad is not readable ({func}): {GUIDANCE}")


def is_guard(t: torch.Tensor | None) -> bool:
    """Whether `t` is a `GradGuard` (a gradient slot the engine has taken over)."""
    return isinstance(t, GradGuard)


def install_grad_guards(groups: Sequence[FlatParamGroup], stage: int) -> None:
    """Put a `GradGuard` in every trainable parameter's `.grad` once its gradient is taken.

    Must run after the reducer registered its hooks: the guard goes in after them.
    """
    for g in groups:
        if not g.trainable:
            continue
        views: Sequence[torch.Tensor | None] = (
            slot_views(g.grad_buffer, g.layout)
            if g.grad_buffer is not None
            else [None] * len(g.params)
        )
        for p, view, slot in zip(g.params, views, g.layout.slots, strict=True):
            # Weakly, as the reducer's hooks: the hooks live in C++ where the cycle
            # collector cannot see a parameter -> hook -> view -> buffer cycle.
            # A leaf's tensor hook runs before autograd accumulates into `.grad`.
            before = _before_accumulate(weakref.ref(p), view, slot.shape)
            p.register_hook(before)  # type: ignore[no-untyped-call]  # untyped in torch
            register = p.register_post_accumulate_grad_hook  # untyped in torch
            # One guard per parameter for its whole life: it holds no memory and no
            # state, and making one costs more than the rest of the hook. A DTensor's
            # `.grad` takes its full shape, which its releases leave as it is.
            shape = p.shape if is_dtensor(p) else torch.Size(slot.shape)
            guard = GradGuard(shape, p.dtype, p.device)
            register(_after_accumulate(view, guard))  # type: ignore[no-untyped-call]


def _before_accumulate(
    param: weakref.ref[nn.Parameter], view: torch.Tensor | None, shape: tuple[int, ...]
) -> Callable[[torch.Tensor], None]:
    def hook(grad: torch.Tensor) -> None:
        p = param()
        if p is not None and is_guard(p.grad):
            # Stage 1 accumulates into its buffer view again; stages 2/3 start empty.
            p.grad = None if view is None else like_param(p, view.view(shape))

    return hook


def _after_accumulate(
    view: torch.Tensor | None, guard: GradGuard
) -> Callable[[torch.Tensor], None]:
    def hook(p: torch.Tensor) -> None:
        grad = None if view is None else local_grad(p)
        if view is not None and grad is not None and grad.data_ptr() != view.data_ptr():
            # Stage 1 after `model.zero_grad()`: autograd made a fresh gradient outside
            # the buffer; fold it in before the slot is guarded.
            view.add_(grad.reshape(view.shape))
        # The guard matches the parameter's shape now: a stage-3 unit released by this
        # parameter's own gradient (the last of its unit) left it empty.
        p.grad = guard if p.shape == guard.shape else GradGuard(p.shape, p.dtype, p.device)

    return hook


# [Note: backward without an optimizer]
# A model initialized without an optimizer (evaluation only) gets no reducer, no gradient
# shards and no guards: its gradients would have nowhere to go. Left in `.grad` they would
# be each rank's unreduced gradient (stages 1/2), and at stage 3 the units backward gathers
# would stay gathered (what releases them is the reducer's "gradients in"). FSDP2 builds
# its reduce-scatter whatever the optimizer; DeepSpeed's engine without one
# (`deepspeed.initialize(model=m)`, built for inference) runs forward and refuses
# `engine.backward` ("must provide optimizer during init in order to use backward"). We
# refuse as DeepSpeed does, with its reason: the first gradient that reaches a trainable
# parameter raises, on every rank alike (each runs the same backward), before anything is
# written into `.grad`. The masters get the same hook: a `zeroshard.compile`d graph takes
# them as its inputs and accumulates its gradients into them, not into the parameters.
NO_BACKWARD = (
    "zeroshard: this model was initialized without an optimizer (evaluation only), so "
    "its gradients have nowhere to go: run forward under torch.no_grad(), or initialize "
    "it with its optimizer to train (see [Note: backward without an optimizer])"
)


def refuse_backward(groups: Sequence[FlatParamGroup]) -> None:
    """Make a backward that reaches a trainable parameter of `groups` (or its master)
    raise `NO_BACKWARD` (see [Note: backward without an optimizer])."""
    for g in groups:
        if g.trainable:
            for p in (*g.params, g.master):
                p.register_hook(_refuse)  # type: ignore[no-untyped-call]  # untyped in torch


def _refuse(grad: torch.Tensor) -> None:
    raise RuntimeError(NO_BACKWARD)
