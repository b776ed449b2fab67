"""What an optimizer that steps whole parameters with its own step() keeps per matrix at
the matrix's owner ([Note: whole parameters] in runtime/whole/_whole_step.py): the one
measurement the planner prices it with and offload's host-memory check counts it with.

[Note: a declared optimizer's state, measured]
Such an optimizer's state need not be shaped like the parameter: Adafactor keeps a row
and a column vector per matrix, Shampoo a preconditioner per side, so no count per
element prices it. The planner, and offload's host-memory check before anything is
allocated (`owned_host_state` in runtime/whole/: [Note: whole parameters offloaded]),
ask the optimizer itself: a probe of it (its class, a copy of its attributes, one of its
param groups' hyperparameters, no state, no hooks: the optimizer is left as it was)
steps once a meta matrix of the shape and the master dtype the owner steps, with a meta
gradient, and its state's tensors of one dim or more are what the owner keeps of that
matrix (the engine moves those between the host and the device: a 0-dim step count is a
few bytes per matrix). Meta tensors cost no memory and give the state's true shapes and
dtypes, so this is exact for a state allocated at the first step. Once per param group
and shape. A step that cannot run on meta (one that reads a value: `.item()`, a
comparison turned into a bool) falls back to the runtime's count per element
(`state_floats`: torch's classes by name, 2 floats for an unknown one).
"""

from __future__ import annotations

import collections
import copy
import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from zeroshard.engine.runtime._optimizer_state import state_floats


class OwnerState:
    """The bytes `optimizers`' param groups keep per whole matrix at its owner, in
    `dtype` (the masters'), measured ([Note: a declared optimizer's state, measured])."""

    def __init__(self, optimizers: Sequence[torch.optim.Optimizer], dtype: torch.dtype) -> None:
        self._groups = [(o, pg) for o in optimizers for pg in o.param_groups]
        self._dtype = dtype
        self._measured: dict[tuple[int, tuple[int, ...]], int] = {}

    def nbytes(self, param_group: int, shape: Sequence[int]) -> int:
        """What param group `param_group` (its index among all optimizers' in turn)
        keeps of one whole matrix of `shape`."""
        key = (param_group, tuple(shape))
        if key not in self._measured:
            optimizer, pg = self._groups[param_group]
            measured = probe_state_bytes(optimizer, pg, key[1], self._dtype)
            if measured is None:
                floats = state_floats(optimizer, pg)
                measured = floats * math.prod(key[1]) * self._dtype.itemsize
            self._measured[key] = measured
        return self._measured[key]


def probe_state_bytes(
    optimizer: torch.optim.Optimizer,
    param_group: dict[str, Any],
    shape: Sequence[int],
    dtype: torch.dtype,
) -> int | None:
    """The bytes of the state tensors (of one dim or more) that `optimizer`, with
    `param_group`'s hyperparameters, keeps after one step of a `shape` matrix in `dtype`
    (on meta: no memory); None where its step cannot run there."""
    param = nn.Parameter(torch.empty(tuple(shape), dtype=dtype, device="meta"))
    param.grad = torch.empty_like(param)
    # A copy of the optimizer's own attributes (a step that changes one in place changes
    # the copy's), but not what it steps or keeps (its parameters are not copied where
    # an attribute reaches them), and no hooks: the step below is the unhooked one, so
    # neither the user's nor torch's global hooks run.
    own = {id(p): p for pg in optimizer.param_groups for p in pg["params"]}
    attrs = {
        k: v
        for k, v in vars(optimizer).items()
        if k not in ("param_groups", "state") and not k.endswith("_hooks")
    }
    step = type(optimizer).step
    try:
        probe = object.__new__(type(optimizer))
        probe.__dict__.update(copy.deepcopy(attrs, own))
        probe.param_groups = [{**param_group, "params": [param]}]
        probe.state = collections.defaultdict(dict)
        probe._optimizer_step_pre_hooks = collections.OrderedDict()
        probe._optimizer_step_post_hooks = collections.OrderedDict()
        getattr(step, "__wrapped__", step)(probe)
    except Exception:  # whatever a step that cannot run on meta raises: counted by rule
        return None
    return sum(
        t.numel() * t.element_size()
        for t in probe.state[param].values()
        if isinstance(t, torch.Tensor) and t.dim()
    )
