"""Grouping parameters into flat buffers: one buffer per (dtype, trainability, groups).

A flat buffer has one dtype, one gradient policy, one optimizer param group (so the
optimizer's per-group settings apply to one shard tensor) and one process group.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

import torch

# The label of the parameters sharded over the default process group (the world, or
# one shard group of hybrid sharding).
DEFAULT_GROUP_LABEL = "default"


@dataclass(frozen=True)
class GroupKey:
    """What parameters must share to live in one flat buffer. `process_group` is a label,
    not a process group: which one the parameters are sharded over (`DEFAULT_GROUP_LABEL`,
    a module path with a group of its own, or tensor parallelism's split label); the
    engine maps it to its `Group`."""

    dtype: torch.dtype
    requires_grad: bool
    param_group: int
    process_group: str


def group_parameters(
    named_params: Iterable[tuple[str, torch.nn.Parameter]],
    *,
    param_group_of: Mapping[int, int] | None = None,
    process_group_of: Callable[[str, torch.nn.Parameter], str] | None = None,
) -> dict[GroupKey, list[tuple[str, torch.nn.Parameter]]]:
    """Group parameters by `GroupKey`, groups and members in first-seen order.

    `param_group_of` maps id(param) to its optimizer param-group index (default 0 for
    all); a trainable param missing from it is a ValueError. A Parameter seen twice
    (tied weights) is kept once, under its first name.
    """
    groups: dict[GroupKey, list[tuple[str, torch.nn.Parameter]]] = {}
    seen: set[int] = set()
    names: set[str] = set()
    for name, p in named_params:
        if id(p) in seen:
            continue
        if name in names:
            raise ValueError(f"two different parameters are both named {name!r}")
        seen.add(id(p))
        names.add(name)
        if param_group_of is None:
            index = 0
        elif id(p) in param_group_of:
            index = param_group_of[id(p)]
        elif p.requires_grad:
            raise ValueError(f"parameter {name!r} requires grad but is in no optimizer param group")
        else:
            # Frozen and not optimized: its key differs by requires_grad anyway.
            index = 0
        pg = DEFAULT_GROUP_LABEL if process_group_of is None else process_group_of(name, p)
        key = GroupKey(p.dtype, p.requires_grad, index, pg)
        groups.setdefault(key, []).append((name, p))
    return groups
