"""torch's fused CPU Adam/AdamW over an offloaded group, one cache-sized block at a time.

[Note: blocked host step]
An offloaded group's step reads its gradient in the reduce dtype (bf16) and steps the fp32
master with the optimizer (with offload_params it also writes the master out in the
compute dtype; otherwise the device casts the masters, [Note: offload upload] in
_upload.py). As passes over the group (an upcast into a group-sized fp32 buffer,
the optimizer, a downcast) the casts cost about as much as the step itself: a group
(~200M elements at 7B) is far past any cache, so each is another trip through memory.
Where the wrapped optimizer is torch's Adam or AdamW with fused=True, the group is walked
in blocks of `STEP_BLOCK` elements instead: the block's gradient is upcast into one small
fp32 scratch (its clipping / unscaling factors applied there, [Note: offload host
memory]), torch's fused kernel steps the block's views of the master and its state, and
with offload_params the block's master is cast into the host shards while still in
cache. Memory then sees the optimizer's own traffic plus the bf16 gradient read (and
the bf16 shard written). The loop and the views it keeps: [Note: blocked step loop] in
_blocks.py.

The same bits as torch's step over the whole group: its kernel updates each element from
that element's gradient, state and hyperparameters alone. The step count is advanced
once per group before its first block, as torch advances it once per parameter before
its kernel (the bias corrections read it). Within a call the kernel runs a vector loop
and then a scalar one over the last `numel % vector width` elements, which may round
otherwise: a block is a multiple of every vector width (and of the kernel's 16-element
work units), so every element takes the same path blocked or not. The state is torch's
(`step`, `exp_avg`, `exp_avg_sq`, `max_exp_avg_sq` with amsgrad), made as torch makes it
on a first step, so state_dict, checkpoints and resume are unchanged.

Anything else (another optimizer, fused off, capturable, differentiable, betas as
tensors, a GradScaler's `grad_scale`/`found_inf` on the optimizer) keeps the step of the
whole group on one group's fp32 upcast.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import torch

from zeroshard.engine.runtime._host_norm import NORM_ROW

# Elements per block: 4 MiB per fp32 array, so a block's master, state and gradient stay
# in the last-level cache between the kernel and the cast; whole norm rows, so the
# blocked norm has the rows of the unblocked one ([Note: host gradient norm]).
STEP_BLOCK = 16 * NORM_ROW

_ADAMS = (torch.optim.Adam, torch.optim.AdamW)


@dataclass(frozen=True)
class FusedAdam:
    """torch's fused CPU kernel and the arguments torch.optim.Adam(W) passes it for one
    param group."""

    kernel: Callable[..., Any]
    lr: float | torch.Tensor
    beta1: float
    beta2: float
    weight_decay: float
    eps: float
    amsgrad: bool
    maximize: bool

    def begin(self, inner: torch.optim.Optimizer, master: torch.Tensor) -> dict[str, Any]:
        """`master`'s state in `inner` (made as torch makes it on a first step) with its
        step count advanced: the state every block of this step is stepped with."""
        state: dict[str, Any] = inner.state[master]
        if len(state) == 0:
            # torch.optim.Adam's fused path: `step` a float32 tensor on the parameter's
            # device, the moments zeros like the parameter.
            state["step"] = torch.zeros((), dtype=torch.float32, device=master.device)
            state["exp_avg"] = torch.zeros_like(master, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(master, memory_format=torch.preserve_format)
            if self.amsgrad:
                state["max_exp_avg_sq"] = torch.zeros_like(
                    master, memory_format=torch.preserve_format
                )
        torch._foreach_add_([state["step"]], 1)
        return state

    @cached_property
    def options(self) -> dict[str, Any]:
        """The kernel's keyword arguments: the same for every block of the group."""
        return {
            "amsgrad": self.amsgrad,
            "lr": self.lr,
            "beta1": self.beta1,
            "beta2": self.beta2,
            "weight_decay": self.weight_decay,
            "eps": self.eps,
            "maximize": self.maximize,
            "grad_scale": None,
            "found_inf": None,
        }


def fused_adam(inner: torch.optim.Optimizer, param_group: int) -> FusedAdam | None:
    """The kernel call torch's fused step makes for `inner`'s param group `param_group`,
    or None where the blocked step does not apply ([Note: blocked host step])."""
    if type(inner) not in _ADAMS:
        return None
    if any(getattr(inner, k, None) is not None for k in ("grad_scale", "found_inf")):
        return None
    pg = inner.param_groups[param_group]
    beta1, beta2 = pg["betas"]
    if not pg["fused"] or pg["capturable"] or pg["differentiable"]:
        return None
    if isinstance(beta1, torch.Tensor) or isinstance(beta2, torch.Tensor):
        return None
    lr = pg["lr"]
    if isinstance(lr, torch.Tensor) and lr.device.type != "cpu":
        # As torch does for CPU parameters: the kernel reads a CPU lr.
        lr = lr.to("cpu")
    # torch < 2.7 keeps AdamW apart from Adam, with no `decoupled_weight_decay` key.
    decoupled = pg.get("decoupled_weight_decay", isinstance(inner, torch.optim.AdamW))
    return FusedAdam(
        torch._fused_adamw_ if decoupled else torch._fused_adam_,
        lr,
        beta1,
        beta2,
        pg["weight_decay"],
        pg["eps"],
        pg["amsgrad"],
        pg["maximize"],
    )


def steps_in_blocks(inner: torch.optim.Optimizer) -> bool:
    """Whether every param group of `inner` gets the blocked step (so no group-sized fp32
    upcast is needed: [Note: offload host memory])."""
    return all(fused_adam(inner, k) is not None for k in range(len(inner.param_groups)))
