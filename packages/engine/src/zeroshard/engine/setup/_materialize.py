"""Partitioned init: materialize a meta-device model one stage-3 unit at a time.

A model built under `torch.device("meta")` has no memory. Before a unit is sharded, its
own parameters get real (empty) storage on the device, in place (`swap_tensors` keeps
the Parameter objects the optimizer already holds), and the modules that own them are
initialized. The unit is then sharded and its full copy freed, so no rank ever holds
more than one unit in full: a model larger than one device initializes.

Every rank must draw the same values, so the random generator is seeded per unit from
`seed` before its init runs (on CPU and on the device). A DTensor parameter (tensor
parallelism) gets storage for its local piece only; `param_init` initializes it as a
DTensor (torch's DTensor random ops, or `distribute_tensor` of a whole value).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from zeroshard.engine.runtime._tensor_parallel import like_param, local_shape
from zeroshard.engine.runtime._unit_plan import UnitPlan

ParamInit = Callable[[nn.Module], None]


def reset_parameters(module: nn.Module) -> None:
    """The default init: the module's own `reset_parameters()`."""
    reset = getattr(module, "reset_parameters", None)
    if not callable(reset):
        raise ValueError(
            f"{type(module).__name__} owns meta-device parameters but has no "
            "reset_parameters(): pass param_init= to initialize()"
        )
    reset()


def is_meta(plan: UnitPlan) -> bool:
    """Whether any parameter of the unit is on the meta device."""
    return any(p.is_meta for _, p in plan.params)


@torch.no_grad()
def materialize_unit(
    plan: UnitPlan, index: int, *, device: torch.device, param_init: ParamInit, seed: int
) -> None:
    """Give the unit's own parameters storage on `device` and initialize them."""
    owned = {id(p) for _, p in plan.params}
    for _, p in plan.params:
        if p.is_meta:
            # A DTensor (tensor parallelism) gets its local piece, and stays a DTensor of
            # its mesh and placement: param_init sees what torch's tp made of the module.
            local = torch.empty(local_shape(p), dtype=p.dtype, device=device)
            real = nn.Parameter(like_param(p, local), requires_grad=p.requires_grad)
            torch.utils.swap_tensors(p, real)  # type: ignore[no-untyped-call]
    torch.manual_seed(seed + index)
    if device.type == "cuda":
        torch.cuda.manual_seed(seed + index)
    for module in plan.module.modules():
        if any(id(p) in owned for p in module.parameters(recurse=False)):
            param_init(module)
