"""Mixed-precision hooks on the root module: cast float inputs in, scale fp16 gradients out.

Parameters are compute-dtype views, so float inputs are cast to the compute dtype on the
way in (as FSDP's `cast_forward_inputs` does). Under fp16, float outputs are cast to fp32
and pass through `_ScaleGrad`, whose backward multiplies the incoming gradient by the loss
scale: every gradient upstream is then scaled exactly as if the loss had been, while the
user keeps calling a plain `loss.backward()`. The cast to fp32 comes first so that the
loss's own gradient is computed in fp32 and cannot underflow before it is scaled.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_map

from zeroshard.engine.runtime._loss_scale import LossScaler


class _ScaleGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        # A tensor, not a float: under torch.compile a float would be a constant of the
        # graph, recompiled at every new scale (see `LossScaler.factor`).
        ctx.save_for_backward(scale)
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        (scale,) = ctx.saved_tensors
        return grad * scale.to(grad.device), None


def install_precision_hooks(
    model: nn.Module, compute_dtype: torch.dtype, scaler: LossScaler | None
) -> None:
    """Register the input cast (non-fp32 compute) and the fp16 gradient scaling on `model`."""
    if compute_dtype == torch.float32:
        return

    def cast(x: Any) -> Any:
        if isinstance(x, torch.Tensor) and x.is_floating_point() and x.dtype != compute_dtype:
            return x.to(compute_dtype)
        return x

    def pre_hook(
        module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        return tree_map(cast, args), tree_map(cast, kwargs)

    model.register_forward_pre_hook(pre_hook, with_kwargs=True)
    if scaler is None:
        return

    def scale_out(x: Any) -> Any:
        if isinstance(x, torch.Tensor) and x.is_floating_point() and x.requires_grad:
            return _ScaleGrad.apply(x.float(), scaler.factor)  # type: ignore[no-untyped-call]
        return x

    def post_hook(module: nn.Module, args: tuple[Any, ...], output: Any) -> Any:
        return tree_map(scale_out, output)

    model.register_forward_hook(post_hook)
