"""How much state torch's optimizers keep per master element: the one rule that CPU
offload's host-memory check and the planner both count with."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

# Master-shaped state tensors per element of torch's optimizers that keep a fixed number
# (torch.optim.Muon: its momentum).
_FIXED = {"Adam": 2, "AdamW": 2, "Adamax": 2, "NAdam": 2, "RAdam": 2, "Adagrad": 1, "Muon": 1}
# What an optimizer not known here is counted as: Adam's two moments, the common case.
UNKNOWN_STATE_FLOATS = 2


def state_floats(optimizer: torch.optim.Optimizer, param_group: Mapping[str, Any]) -> int:
    """Master-shaped state tensors `optimizer` keeps per element of `param_group` (one of
    its param groups), a subclass's by the nearest class known here;
    `UNKNOWN_STATE_FLOATS` for an optimizer of none."""
    known = ("SGD", "RMSprop", *_FIXED)
    name = next(
        (c.__name__ for c in type(optimizer).__mro__ if c.__name__ in known),
        type(optimizer).__name__,
    )
    if name == "SGD":
        return int(bool(param_group.get("momentum", 0)))
    if name == "RMSprop":
        return 1 + bool(param_group.get("centered")) + bool(param_group.get("momentum"))
    return _FIXED.get(name, UNKNOWN_STATE_FLOATS)


def state_floats_by_param_group(optimizers: list[torch.optim.Optimizer]) -> dict[int, int]:
    """`state_floats` of every param group of `optimizers`, by its index among all their
    param groups in turn (`GroupKey.param_group`)."""
    pairs = [(o, pg) for o in optimizers for pg in o.param_groups]
    return {k: state_floats(o, pg) for k, (o, pg) in enumerate(pairs)}
