"""`check_ranks_agree`: every rank must initialize the same model with the same config;
`raise_if_any_failed`: a step of initialize that failed on one rank fails it on every rank.

[Note: the initialize digest]
Ranks that disagree (stage 2 on one, 3 on another; fp32 against bf16; one extra layer)
would issue different collectives, and gloo aborts the process or a rank reads past the
end of its unit list. So `initialize` first describes, as a list of (field, value)
strings, what must be equal on every rank: every config field, the world size, the
optimizers' types, every parameter's name, shape, dtype, requires_grad, optimizer param
group and whether it is on the meta device (and a DTensor's placement), every buffer's
name, shape and dtype (the weights are then broadcast: [Note: one set of initial
weights]), and the device mesh's dims and shape, and compares it across ranks before any
other collective (zeroshard.comm's `Agreement.check_same`: one all-gather of two
integers when they agree).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from zeroshard.comm import Agreement, Group
from zeroshard.engine.runtime._optimizers import CombinedOptimizer


def describe_rank(
    config: Any,
    world: Group,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    mesh: DeviceMesh | None = None,
) -> list[tuple[str, str]]:
    """What must be equal on every rank, as (field, value) strings in a fixed order
    (`optimizer` None: initialized for evaluation only)."""
    fields = list(_config_fields("config", config))
    fields.append(("world size", str(world.size)))
    combined = optimizer.optimizers if isinstance(optimizer, CombinedOptimizer) else [optimizer]
    names = ", ".join(type(o).__name__ for o in combined if o is not None)
    fields.append(("optimizers", names or "none"))
    shape = None if mesh is None else dict(zip(mesh.mesh_dim_names or (), mesh.shape, strict=False))
    fields.append(("device_mesh", str(shape)))
    groups = [] if optimizer is None else optimizer.param_groups
    group_of = {id(p): k for k, pg in enumerate(groups) for p in pg["params"]}
    # Buffers before parameters: the first difference of a model with an extra layer is
    # then its first parameter, shown against "(absent)".
    for i, (name, b) in enumerate(model.named_buffers()):
        fields.append((f"buffer {i}", f"{name} {tuple(b.shape)} {b.dtype}"))
    for i, (name, p) in enumerate(model.named_parameters()):
        value = (
            f"{name} {tuple(p.shape)} {p.dtype} requires_grad={p.requires_grad} "
            f"param_group={group_of.get(id(p))} meta={p.is_meta}"
        )
        if isinstance(p, DTensor):
            value += f" placements={p.placements}"
        fields.append((f"parameter {i}", value))
    return fields


def _config_fields(prefix: str, value: Any) -> list[tuple[str, str]]:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        out: list[tuple[str, str]] = []
        for f in dataclasses.fields(value):
            out += _config_fields(f"{prefix}.{f.name}", getattr(value, f.name))
        return out
    return [(prefix, repr(value))]


def check_ranks_agree(world: Group, fields: Sequence[tuple[str, str]]) -> None:
    """Raise the same ValueError on every rank if `fields` differ between ranks."""
    Agreement(world).check_same(
        fields,
        "at initialize",
        "initialize: ranks agree",
        "Every rank must build the same model and pass the same config",
    )


def raise_if_any_failed(world: Group, what: str, error: Exception | None) -> None:
    """Raise the same RuntimeError on every rank if any rank's `error` is set (None where
    its `what` succeeded), naming the failing ranks and the first one's error."""
    Agreement(world).outcome(error, what)
