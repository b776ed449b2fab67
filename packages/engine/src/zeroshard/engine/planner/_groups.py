"""The flat groups `initialize()` would build, planned without building them.

Everything here is metadata: a model on the meta device is enough. Each rule of what the
engine builds is the runtime's own function, called here as the engine calls it:
`plan_units` and `is_persistent` (stage 3), `plan_buckets` (stages 1/2), `flat_layout`,
`choose_offloaded` and `offload_sizes`. `tests/engine/test_estimate_states.py` checks the
bytes counted from them against real engines.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import nn

from zeroshard.engine.config._config import ZeroConfig
from zeroshard.engine.runtime._bucket_plan import plan_buckets
from zeroshard.engine.runtime._flat_group import flat_layout
from zeroshard.engine.runtime._names import named_parameters
from zeroshard.engine.runtime._unit_plan import is_persistent, plan_units
from zeroshard.engine.runtime.offload._plan import OffloadSizes, choose_offloaded, offload_sizes
from zeroshard.partition import FlatLayout, GroupKey, group_parameters


@dataclass(frozen=True)
class PlannedGroup:
    """One flat group as `initialize()` would lay it out on every rank."""

    index: int
    key: GroupKey
    layout: FlatLayout
    unit: int | None  # stage 3: the unit owning it
    persistent: bool  # stage 3: its unit stays gathered for the whole step
    offloaded: bool

    @property
    def trainable(self) -> bool:
        """Whether its parameters take gradients."""
        return self.key.requires_grad


@dataclass(frozen=True)
class PlannedUnit:
    """Stage 3: a unit's name, gathered bytes and whether it stays gathered."""

    name: str
    gathered_bytes: int
    persistent: bool


@dataclass(frozen=True)
class GroupPlan:
    """All flat groups (and stage-3 units) of a model under one config and shard-group size."""

    groups: tuple[PlannedGroup, ...]
    units: tuple[PlannedUnit, ...]
    offload: OffloadSizes | None  # what HostOffload allocates (None: nothing offloaded)
    shard_size: int


def _stage12(
    model: nn.Module, cfg: ZeroConfig, size: int, param_group_of: Mapping[int, int] | None
) -> list[tuple[GroupKey, FlatLayout]]:
    """The stage-1/2 flat groups, in the order `initialize()` builds them."""
    grouped = group_parameters(named_parameters(model), param_group_of=param_group_of)
    compute = cfg.precision.compute_dtype
    buckets = plan_buckets(model, grouped, cfg.comm.reduce_bucket_bytes, compute.itemsize)
    return [(key, flat_layout(run, key, size, compute)) for key, run in buckets]


def plan_groups(
    model: nn.Module,
    cfg: ZeroConfig,
    shard_size: int,
    param_group_of: Mapping[int, int] | None = None,
    blocked_step: bool = False,
) -> GroupPlan:
    """The flat groups one rank holds when `model` is sharded over `shard_size` ranks.

    `param_group_of` maps id(parameter) to its optimizer param group (None: all in one);
    `blocked_step`: the optimizer steps offloaded groups in blocks (torch's fused
    Adam/AdamW), so the host needs one block's fp32 upcast, not one group's.
    """
    planned: list[tuple[GroupKey, FlatLayout, int | None, bool]] = []
    units: list[PlannedUnit] = []
    if cfg.stage == 3:
        plans = plan_units(model, cfg.stage3)
        for ui, plan in enumerate(plans):
            grouped = group_parameters(plan.params, param_group_of=param_group_of)
            layouts = [
                (k, flat_layout(named, k, shard_size, cfg.precision.compute_dtype))
                for k, named in grouped.items()
            ]
            numel = sum(lay.numel for _, lay in layouts)
            persistent = is_persistent(ui, numel, cfg.stage3.persistence_threshold)
            planned += [(k, lay, ui, persistent) for k, lay in layouts]
            gathered = (
                sum(lay.padded_numel for _, lay in layouts) * cfg.precision.compute_dtype.itemsize
            )
            units.append(PlannedUnit(plan.name, gathered, persistent))
    else:
        planned = [
            (k, lay, None, False) for k, lay in _stage12(model, cfg, shard_size, param_group_of)
        ]
    offloaded: set[int] = set()
    if cfg.offload.optimizer:
        numels = [lay.shard_numel for _, lay, _, _ in planned]
        trainable = [k.requires_grad for k, _, _, _ in planned]
        offloaded = set(
            choose_offloaded(
                numels, trainable, cfg.offload.ratio, registration_order=cfg.stage == 3
            )
        )
    groups = tuple(
        PlannedGroup(i, k, lay, unit, persistent, i in offloaded)
        for i, (k, lay, unit, persistent) in enumerate(planned)
    )
    moved = [g.layout.shard_numel for g in groups if g.offloaded]
    offload = None
    if moved:
        offload = offload_sizes(
            moved,
            shard_size,
            chunk_bytes=cfg.offload.chunk_bytes,
            compute_dtype=cfg.precision.compute_dtype,
            reduce_dtype=cfg.precision.grad_reduce_dtype,
            offload_params=cfg.offload.params,
            blocked_step=blocked_step,
        )
    return GroupPlan(groups, tuple(units), offload, shard_size)


def state_bytes(
    plan: GroupPlan, cfg: ZeroConfig, optimizer_bytes_per_element: int
) -> dict[str, int]:
    """Device bytes one rank keeps between steps, by kind (gradients freed by zero_grad)."""
    compute = cfg.precision.compute_dtype.itemsize
    out = {"parameters": 0, "master": 0, "optimizer": 0, "grad_buffer": 0, "offload_compute": 0}
    for g in plan.groups:
        if cfg.stage != 3:
            out["parameters"] += g.layout.padded_numel * compute
            if cfg.stage == 1 and g.trainable:
                out["grad_buffer"] += g.layout.padded_numel * compute
        if not g.offloaded:
            out["master"] += g.layout.shard_numel * 4
            if g.trainable:
                out["optimizer"] += g.layout.shard_numel * optimizer_bytes_per_element
    if plan.offload is not None:
        out["offload_compute"] = plan.offload.device_bytes
    return out


def grad_shard_bytes(plan: GroupPlan) -> int:
    """Device bytes of the fp32 gradient shards during a step (offloaded ones live on the host)."""
    return sum(g.layout.shard_numel * 4 for g in plan.groups if g.trainable and not g.offloaded)


def reduce_dtype_bytes(cfg: ZeroConfig) -> int:
    """Bytes per element of a gradient bucket."""
    return torch.empty(0, dtype=cfg.precision.grad_reduce_dtype).element_size()
