"""The flat groups `initialize` builds: planned (each group's wire and home: [Note: home
and wire] in runtime/_home.py), then built into their homes with their wires, at stage 3
unit by unit (units still on the meta device materialized just before)."""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from zeroshard.comm import Group
from zeroshard.engine.config._config import ZeroConfig
from zeroshard.engine.runtime._flat_group import FlatParamGroup, build_flat_group
from zeroshard.engine.runtime._float8 import float8_weights, gathered_in_float8
from zeroshard.engine.runtime._float8_gather import Float8Wires
from zeroshard.engine.runtime._group_plan import FlatGroupPlan, PlannedFlatGroup, plan_flat_groups
from zeroshard.engine.runtime._home import DeviceHomes, HomeBuilder, HomeKind
from zeroshard.engine.runtime._stage3 import Stage3Runtime
from zeroshard.engine.runtime._stats import EngineStats
from zeroshard.engine.runtime._wire import ComputeCasts, WireBuilder, WireKind, refresh_wires
from zeroshard.engine.runtime.offload import HostOffload, build_host_storage, plan_offload
from zeroshard.engine.setup._materialize import ParamInit, is_meta, materialize_unit
from zeroshard.engine.setup._placement import Placement
from zeroshard.partition import FlattenTier

log = logging.getLogger("zeroshard.engine")


@dataclass(frozen=True)
class GroupsPlan:
    """The plan of every flat group, and the builders of the homes and wires it names
    (`host`: CPU offload's host storage, None when nothing is offloaded; `takes_grads`:
    False for an engine without an optimizer, which takes no gradients)."""

    plan: FlatGroupPlan
    homes: Mapping[HomeKind, HomeBuilder]
    wires: Mapping[WireKind, WireBuilder]
    host: HostOffload | None
    takes_grads: bool


def plan_groups(
    model: nn.Module,
    cfg: ZeroConfig,
    placement: Placement,
    everyone: Group,
    optimizers: Sequence[torch.optim.Optimizer],
    param_group_of: Mapping[int, int] | None,
    stats: EngineStats,
) -> GroupsPlan:
    """Plan the flat groups of `model` and make their homes' and wires' builders (the host
    storage of the offloaded ones allocated, after every host was found to hold it)."""
    fp8 = gathered_in_float8(model, cfg)
    if not fp8 and everyone.rank == 0 and float8_weights(model):
        log.info(
            "zeroshard: enable_fsdp_float8_all_gather: stage %d gathers the fp8 weights in "
            "the compute dtype (their Float8Linears cast them, as without the option)",
            cfg.stage,
        )
    plan = plan_flat_groups(
        model,
        cfg,
        size_of=lambda key: placement.process_group(key).size,
        param_group_of=param_group_of,
        process_group_of=placement.label,
        float8=fp8,
    )
    shard_group = placement.shard_group
    plan, sizes = plan_offload(plan, cfg, shard_group.size, optimizers)
    host = None
    if sizes is not None:
        host = build_host_storage(plan, sizes, cfg, everyone, optimizers, shard_group)
    compute = cfg.precision.compute_dtype
    wires: dict[WireKind, WireBuilder] = {WireKind.COMPUTE: ComputeCasts(compute)}
    if any(g.wire is WireKind.FLOAT8 for g in plan.groups):
        tp = None if placement.mesh is None else placement.mesh.tensor_parallel.group
        wires[WireKind.FLOAT8] = Float8Wires(fp8, compute, stats, tp)
    elif fp8 and everyone.rank == 0:
        log.info(
            "zeroshard: enable_fsdp_float8_all_gather: a process group of one rank "
            "gathers nothing, so the fp8 weights gather in the compute dtype (their "
            "Float8Linears cast them: the same bits, one gather less per unit)"
        )
    homes: dict[HomeKind, HomeBuilder] = {HomeKind.DEVICE: DeviceHomes(cfg.precision.master_dtype)}
    if host is not None:
        homes[HomeKind.HOST] = host
    return GroupsPlan(plan, homes, wires, host, takes_grads=bool(optimizers))


def build_groups(
    planned: GroupsPlan,
    cfg: ZeroConfig,
    placement: Placement,
    stats: EngineStats,
    *,
    param_init: ParamInit,
    init_seed: int,
) -> tuple[tuple[FlatParamGroup, ...], Stage3Runtime | None]:
    """Every flat group of `planned`, built; at stage 3 also the runtime of its units.
    What the wires send is then taken from the masters (collective: fp8's scales)."""
    plan = planned.plan
    stage3 = None
    if cfg.stage == 3:
        units = []
        for ui, unit in enumerate(plan.units):
            if is_meta(unit):
                device = placement.shard_group.device
                materialize_unit(unit, ui, device=device, param_init=param_init, seed=init_seed)
            units.append(
                (unit, tuple(_build(g, planned, cfg, placement) for g in plan.groups_of(ui)))
            )
        groups = tuple(g for _, unit_groups in units for g in unit_groups)
        stage3 = Stage3Runtime(
            units,
            shard_group=placement.shard_group,
            prefetch_depth=cfg.stage3.prefetch_depth,
            prefetch_bytes=cfg.stage3.prefetch_bytes,
            max_live_bytes=cfg.stage3.max_live_bytes,
            persistence_threshold=cfg.stage3.persistence_threshold,
            stats=stats,
        )
    else:
        # Stages 1/2: flat groups of about `reduce_bucket_bytes`, in gradient-ready order.
        groups = tuple(_build(g, planned, cfg, placement) for g in plan.groups)
    refresh_wires(groups)
    return groups, stage3


def _build(
    g: PlannedFlatGroup, planned: GroupsPlan, cfg: ZeroConfig, placement: Placement
) -> FlatParamGroup:
    """Build planned group `g` into its home, with its wire."""
    return build_flat_group(
        g.index,
        g.key,
        g.named,
        g.layout,
        process_group=placement.process_group(g.key),
        compute_dtype=cfg.precision.compute_dtype,
        stage=cfg.stage,
        tier=FlattenTier(cfg.flatten_tier),
        home=planned.homes[g.home],
        wire=planned.wires[g.wire],
        takes_grads=planned.takes_grads,
        grad_divisor=placement.grad_divisor(g.key),
    )
