"""The flat groups `initialize()` would build, planned without building them.

Everything here is metadata: a model on the meta device is enough. The groups, their
layouts, which are offloaded and what the host allocates are the runtime's own plan
(`plan_flat_groups`, from which `initialize()` builds), and which units stay gathered
its `is_persistent`. `tests/engine/test_estimate_states.py` checks the bytes counted from
them against real engines.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from zeroshard.engine.config._config import ZeroConfig
from zeroshard.engine.runtime._float8 import gathered_in_float8
from zeroshard.engine.runtime._group_plan import (
    PlannedFlatGroup,
    ProcessGroupOf,
    plan_flat_groups,
)
from zeroshard.engine.runtime._home import HomeKind
from zeroshard.engine.runtime._tensor_parallel import group_label, own_path
from zeroshard.engine.runtime._unit_plan import is_persistent
from zeroshard.engine.runtime._wire import WireKind
from zeroshard.engine.runtime.offload import OffloadSizes, place_offloaded
from zeroshard.engine.runtime.whole import whole_param_groups
from zeroshard.partition import GroupKey


@dataclass(frozen=True)
class PlannedUnit:
    """Stage 3: a unit's name, gathered bytes and whether it stays gathered."""

    name: str
    gathered_bytes: int
    persistent: bool


@dataclass(frozen=True)
class GroupPlan:
    """All flat groups (and stage-3 units) of a model under one config and shard-group size."""

    groups: tuple[PlannedFlatGroup, ...]
    units: tuple[PlannedUnit, ...]
    offload: OffloadSizes | None  # what HostOffload allocates (None: nothing offloaded)
    shard_size: int


def plan_groups(
    model: nn.Module,
    cfg: ZeroConfig,
    shard_size: int,
    param_group_of: Mapping[int, int] | None = None,
    blocked_step: bool = False,
    process_group_of: ProcessGroupOf | None = None,
    own_sizes: Mapping[str, int] | None = None,
) -> GroupPlan:
    """The flat groups one rank holds when `model` is sharded over `shard_size` ranks.

    `param_group_of` maps id(parameter) to its optimizer param group (None: all in one);
    `blocked_step`: the optimizer steps offloaded groups in blocks (torch's fused
    Adam/AdamW), so the host needs one block's fp32 upcast, not one group's;
    `process_group_of` labels a parameter's flat groups (tensor parallelism: split or not);
    `own_sizes` maps module paths on process groups of their own (experts) to the size of
    such a group, over which their flat groups are sharded (`initialize`'s
    `process_groups`; not with `process_group_of`).
    """
    sizes = dict(own_sizes or {})

    def own_label(name: str, _: nn.Parameter) -> str:
        return group_label(name, False, sizes)

    if sizes:
        assert process_group_of is None
        process_group_of = own_label

    def size_of(key: GroupKey) -> int:
        path = own_path(key.process_group)
        return shard_size if path is None else sizes[path]

    plan = plan_flat_groups(
        model,
        cfg,
        size_of=size_of,
        param_group_of=param_group_of,
        process_group_of=process_group_of,
        float8=gathered_in_float8(model, cfg),
    )
    plan, offload = place_offloaded(plan, cfg, shard_size, blocked_step=blocked_step)
    itemsize = cfg.precision.compute_dtype.itemsize
    units: list[PlannedUnit] = []
    for ui, unit in enumerate(plan.units):
        groups = plan.groups_of(ui)
        numel = sum(g.layout.numel for g in groups)
        persistent = is_persistent(ui, numel, cfg.stage3.persistence_threshold)
        # torchao's fp8 weights gather one byte per element ([Note: the fp8 gather]).
        gathered = sum(
            g.layout.padded_numel * (1 if g.wire is WireKind.FLOAT8 else itemsize) for g in groups
        )
        units.append(PlannedUnit(unit.name, gathered, persistent))
    return GroupPlan(plan.groups, tuple(units), offload, shard_size)


def state_bytes(
    plan: GroupPlan, cfg: ZeroConfig, optimizer_bytes_per_element: int | Mapping[int, int]
) -> dict[str, int]:
    """Device bytes one rank keeps between steps, by kind (gradients freed by zero_grad).
    `optimizer_bytes_per_element`: one figure for every param group, or one per param
    group index (those missing: 8, AdamW's), for fp32 masters: torch's optimizers keep
    their state in the master's dtype, so bf16 masters (`precision.master_dtype`) halve it."""
    compute = cfg.precision.compute_dtype.itemsize
    master = cfg.precision.master_dtype.itemsize
    out = {"parameters": 0, "master": 0, "optimizer": 0, "grad_buffer": 0, "offload_compute": 0}
    for g in plan.groups:
        if cfg.stage != 3:
            out["parameters"] += g.layout.padded_numel * compute
            if cfg.stage == 1 and g.trainable:
                out["grad_buffer"] += g.layout.padded_numel * compute
        if g.home is HomeKind.DEVICE:
            out["master"] += g.layout.shard_numel * master
            if g.trainable:
                per = (
                    optimizer_bytes_per_element.get(g.key.param_group, 8)
                    if isinstance(optimizer_bytes_per_element, Mapping)
                    else optimizer_bytes_per_element
                )
                out["optimizer"] += g.layout.shard_numel * per * master // 4
    if plan.offload is not None:
        out["offload_compute"] = plan.offload.device_bytes
    return out


def host_bytes(
    plan: GroupPlan,
    cfg: ZeroConfig,
    optimizer_bytes_per_element: int | Mapping[int, int],
    optimizers: Sequence[torch.optim.Optimizer] = (),
    *,
    step_in_backward: bool = False,
) -> tuple[int, int]:
    """Offload's host bytes per rank (its buffers, the masters and the optimizer state of
    the groups on the host) and the pinned ones of them; (0, 0) with nothing offloaded.
    `optimizer_bytes_per_element` as `state_bytes` takes it; `step_in_backward`: every
    backward runs under `step_in_backward()`, where no gradient is held until `step()`
    but those of host groups that step only then (whole-matrix `optimizers`')."""
    if plan.offload is None:
        return 0, 0
    after_backward = whole_param_groups(optimizers)
    held = not step_in_backward or any(
        g.home is HomeKind.HOST and g.trainable and g.key.param_group in after_backward
        for g in plan.groups
    )
    state = host_state_bytes(plan, cfg, optimizer_bytes_per_element)
    offload = plan.offload
    # Gradients stepped as they land pass through the staging slots; without it none does.
    staged = step_in_backward
    # offload.pin_memory off: every buffer is pageable (the runtime pins none).
    pinned = offload.pinned_bytes(grads_held=held, staged=staged) if cfg.offload.pin_memory else 0
    return offload.host_bytes(grads_held=held, staged=staged) + state, pinned


def host_state_bytes(
    plan: GroupPlan, cfg: ZeroConfig, optimizer_bytes_per_element: int | Mapping[int, int]
) -> int:
    """The optimizer state per element of the groups on the host (`optimizer_bytes_per_element`
    as `state_bytes` takes it); whole-parameter optimizers' state at their owners aside."""
    # torch's optimizers keep their state in the master's dtype.
    master = cfg.precision.master_dtype.itemsize
    return sum(
        g.layout.shard_numel
        * (
            optimizer_bytes_per_element.get(g.key.param_group, 8)
            if isinstance(optimizer_bytes_per_element, Mapping)
            else optimizer_bytes_per_element
        )
        * master
        // 4
        for g in plan.groups
        if g.home is HomeKind.HOST and g.trainable
    )


def snapshot_bytes(
    plan: GroupPlan, cfg: ZeroConfig, optimizer_bytes_per_element: int | Mapping[int, int]
) -> int:
    """One rank's snapshot (`zeroshard.engine.Snapshots`) in bytes: its masters and
    optimizer state, what its checkpoint file holds; under `offload.delay_param_update`
    also its shard of the trainable parameters one step behind the masters, in the
    compute dtype ([Note: a snapshot of a lagging run] in recovery/_contents.py)."""
    master = cfg.precision.master_dtype.itemsize
    behind = cfg.precision.compute_dtype.itemsize if cfg.offload.delay_param_update else 0
    total = 0
    for g in plan.groups:
        total += g.layout.shard_numel * master
        if g.trainable:
            per = (
                optimizer_bytes_per_element.get(g.key.param_group, 8)
                if isinstance(optimizer_bytes_per_element, Mapping)
                else optimizer_bytes_per_element
            )
            total += g.layout.shard_numel * per * master // 4 + g.layout.shard_numel * behind
    return total


def journal_entry_bytes(plan: GroupPlan, cfg: ZeroConfig) -> int:
    """One rank's journal entry (`Snapshots(full_every=K)`) in bytes: the gradient shards
    of its trainable groups in the master dtype (its header, buffers and user state
    aside)."""
    master = cfg.precision.master_dtype.itemsize
    return sum(g.layout.shard_numel * master for g in plan.groups if g.trainable)


def snapshot_host_bytes(
    snapshot: int, world_size: int, entry: int = 0, full_every: int = 1
) -> tuple[int, int]:
    """Host bytes per rank that snapshots every N steps take (docs/reliability.md,
    "Recovery from memory"), of one rank's `snapshot`: between snapshots, its two slots
    (the newest complete step and the one before, pinned under CUDA) and the replica it
    keeps for a rank of another node; while one is taken, a second replica too. One rank
    alone keeps no replica. With a journal (`full_every` > 1) of entries of `entry` bytes,
    its ring of `full_every` entry slots (pinned: the K - 1 entries since the full
    snapshot and one more, so that the full snapshot's background work overlaps the
    next steps) and as many replicas of entries."""
    replica = 0 if world_size == 1 else snapshot
    journal = full_every * entry * (1 if world_size == 1 else 2) if full_every > 1 else 0
    return 2 * snapshot + replica + journal, 2 * snapshot + 2 * replica + journal


def state_rows(states: Mapping[str, int], grad_shards: int) -> list[str]:
    """The memory table's rows of the model states: the header, each kind held, their
    sum, and the gradient shards a step adds."""
    rows = ["| per rank | GiB |", "|---|---|"]
    rows += [f"| {k.replace('_', ' ')} | {n / 2**30:.2f} |" for k, n in states.items() if n]
    return [
        *rows,
        f"| = model states between steps | {sum(states.values()) / 2**30:.2f} |",
        f"| gradient shards (in a step) | {grad_shards / 2**30:.2f} |",
    ]


def grad_shard_bytes(plan: GroupPlan, cfg: ZeroConfig) -> int:
    """Device bytes of the gradient shards (in the master dtype) during a step (offloaded
    ones live on the host)."""
    master = cfg.precision.master_dtype.itemsize
    return sum(
        g.layout.shard_numel * master
        for g in plan.groups
        if g.trainable and g.home is HomeKind.DEVICE
    )


def reduce_dtype_bytes(cfg: ZeroConfig) -> int:
    """Bytes per element of a gradient bucket."""
    return torch.empty(0, dtype=cfg.precision.grad_reduce_dtype).element_size()
