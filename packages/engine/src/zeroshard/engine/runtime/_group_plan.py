"""The flat groups of a model, planned before any is built.

Shapes are enough (a model on the meta device will do): which parameters make up each
flat group (`plan_buckets` at stages 1/2, one group per `GroupKey` of each unit of
`plan_units` at stage 3, where torchao's fp8 weights that gather in fp8 get groups of
their own where their process group has several ranks), its layout (`flat_layout`),
and each group's two axes ([Note: home and wire] in _home.py): how it travels (`wire`)
and where it lives (`home`: the device here; CPU offload's face moves some to the host,
`offload.place_offloaded`). `initialize()` builds each group from it; the planner counts
it. One plan, so neither can drift from the other.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, replace

import torch
from torch import nn

from zeroshard.engine.config._config import ZeroConfig
from zeroshard.engine.runtime._bucket_plan import plan_buckets
from zeroshard.engine.runtime._flat_group import flat_layout
from zeroshard.engine.runtime._home import HomeKind
from zeroshard.engine.runtime._names import named_parameters
from zeroshard.engine.runtime._unit_plan import UnitPlan, plan_units
from zeroshard.engine.runtime._wire import WireKind
from zeroshard.partition import FlatLayout, GroupKey, group_parameters

ProcessGroupOf = Callable[[str, nn.Parameter], str]


@dataclass(frozen=True)
class PlannedFlatGroup:
    """One flat group as `initialize()` builds it: its parameters (canonical names), layout,
    stage-3 unit, where it lives (`home`) and how it travels (`wire`: fp8 for torchao's fp8
    weights, [Note: the fp8 gather])."""

    index: int
    key: GroupKey
    named: tuple[tuple[str, nn.Parameter], ...]
    layout: FlatLayout
    unit: int | None
    wire: WireKind = WireKind.COMPUTE
    home: HomeKind = HomeKind.DEVICE

    @property
    def trainable(self) -> bool:
        """Whether its parameters take gradients."""
        return self.key.requires_grad


@dataclass(frozen=True)
class FlatGroupPlan:
    """Every flat group of a model and the stage-3 units they belong to (registration
    order; none at stages 1/2)."""

    units: tuple[UnitPlan, ...]
    groups: tuple[PlannedFlatGroup, ...]

    def groups_of(self, unit: int) -> list[PlannedFlatGroup]:
        """Stage 3: the groups of unit `unit`, in index order."""
        return [g for g in self.groups if g.unit == unit]

    def homed(self, homes: Collection[int], kind: HomeKind) -> FlatGroupPlan:
        """This plan with the groups of index in `homes` living in `kind`."""
        groups = tuple(replace(g, home=kind) if g.index in homes else g for g in self.groups)
        return FlatGroupPlan(self.units, groups)


def plan_flat_groups(
    model: nn.Module,
    cfg: ZeroConfig,
    *,
    size_of: Callable[[GroupKey], int],
    param_group_of: Mapping[int, int] | None,
    process_group_of: ProcessGroupOf | None = None,
    float8: Collection[int] = frozenset(),
) -> FlatGroupPlan:
    """The flat groups of `model` under `cfg`, each sharded over `size_of(key)` ranks.

    `param_group_of` maps id(parameter) to its optimizer param group (None: all in one),
    `process_group_of` names a parameter's process group (None: the default one for all);
    `float8`: the ids of the weights to gather in fp8 (stage 3: groups of their own).
    Every group lives on the device here.
    Where a key's process group has one rank they gather in the compute dtype, as the
    rest: a gather of one rank moves no bytes, so fp8 would save nothing and cost a
    group and a gather of its own per unit, and the `Float8Linear` casting the weight
    itself computes the same bits ([Note: the fp8 gather]).
    """
    compute = cfg.precision.compute_dtype
    planned: list[tuple[GroupKey, list[tuple[str, nn.Parameter]], int | None]] = []
    fp8: set[int] = set()  # indices into `planned` of the groups gathered in fp8
    units: tuple[UnitPlan, ...] = ()
    if cfg.stage == 3:
        units = tuple(plan_units(model, cfg.stage3))
        for ui, unit in enumerate(units):
            grouped = group_parameters(
                unit.params, param_group_of=param_group_of, process_group_of=process_group_of
            )
            for key, named in grouped.items():
                moves_bytes = size_of(key) > 1  # a gather of one rank moves nothing
                narrow = [(n, p) for n, p in named if moves_bytes and id(p) in float8]
                wide = [(n, p) for n, p in named if not (moves_bytes and id(p) in float8)]
                if wide:
                    planned.append((key, wide, ui))
                if narrow:
                    fp8.add(len(planned))
                    planned.append((key, narrow, ui))
    else:
        grouped = group_parameters(
            named_parameters(model),
            param_group_of=param_group_of,
            process_group_of=process_group_of,
        )
        buckets = plan_buckets(model, grouped, cfg.comm.reduce_bucket_bytes, compute.itemsize)
        planned = [(key, run, None) for key, run in buckets]
    # fp8 buffers align their slots to 16 bytes too (fp8 matmuls need it): 16 elements.
    layouts = [
        flat_layout(named, key, size_of(key), torch.uint8 if i in fp8 else compute)
        for i, (key, named, _) in enumerate(planned)
    ]
    return FlatGroupPlan(
        units,
        tuple(
            PlannedFlatGroup(
                i,
                key,
                tuple(named),
                layout,
                unit,
                WireKind.FLOAT8 if i in fp8 else WireKind.COMPUTE,
            )
            for i, ((key, named, unit), layout) in enumerate(zip(planned, layouts, strict=True))
        ),
    )
