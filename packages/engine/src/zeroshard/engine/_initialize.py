"""`initialize()`: shard a model and its optimizer; `full_state_dict()`: gather them back."""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
from torch import nn

from zeroshard.comm import Group, make_hybrid_groups, warn_on_rank0
from zeroshard.engine._config import ZeroConfig, as_config
from zeroshard.engine._flat_group import FlatParamGroup, build_flat_group, build_sharded_group
from zeroshard.engine._grad_guard import install_grad_guards
from zeroshard.engine._loss_scale import LossScaler
from zeroshard.engine._materialize import ParamInit, is_meta, materialize_unit, reset_parameters
from zeroshard.engine._module_state import install_state_dict_hooks
from zeroshard.engine._offload import HostOffload, choose_offloaded
from zeroshard.engine._optimizer import ZeroOptimizer
from zeroshard.engine._precision import install_precision_hooks
from zeroshard.engine._reduce import GradReducer
from zeroshard.engine._stage3 import EngineStats, Stage3Runtime, Unit
from zeroshard.engine._units import plan_units
from zeroshard.partition import FlattenTier, GroupKey, group_parameters

log = logging.getLogger("zeroshard.engine")

_ATTR = "_zeroshard_engine"


@dataclass(frozen=True)
class EngineState:
    """What `initialize` attached to a model: its config, flat groups and optimizer."""

    config: ZeroConfig
    world: Group
    replicate: Group | None
    groups: tuple[FlatParamGroup, ...]
    optimizer: ZeroOptimizer
    stage3: Stage3Runtime | None
    offload: HostOffload | None = None


def _split_by_bytes(
    named: list[tuple[str, nn.Parameter]], limit: int, itemsize: int
) -> list[list[tuple[str, nn.Parameter]]]:
    """Consecutive runs of parameters of at most `limit` bytes (a big one stands alone)."""
    out: list[list[tuple[str, nn.Parameter]]] = []
    size = 0
    for item in named:
        nbytes = item[1].numel() * itemsize
        if not out or size + nbytes > limit:
            out.append([])
            size = 0
        out[-1].append(item)
        size += nbytes
    return out


@dataclass(frozen=True)
class _Placement:
    """Which process group each parameter is sharded and reduced over."""

    world: Group
    own: Mapping[str, Group]  # module path -> the data-parallel group of its parameters

    def label(self, name: str, param: nn.Parameter) -> str:
        """The longest module path of `own` that contains parameter `name`, or 'default'."""
        best = "default"
        for path in self.own:
            if name.startswith(path + ".") and (best == "default" or len(path) > len(best)):
                best = path
        return best

    def group(self, key: GroupKey) -> Group:
        """The process group of a GroupKey."""
        return self.world if key.process_group == "default" else self.own[key.process_group]


def _flatten_stage12(
    model: nn.Module, cfg: ZeroConfig, place: _Placement, param_group_of: dict[int, int]
) -> tuple[tuple[FlatParamGroup, ...], GradReducer]:
    """Stages 1/2: flat groups of about `reduce_bucket_bytes`, in gradient-ready order."""
    grouped = group_parameters(
        model.named_parameters(), param_group_of=param_group_of, process_group_of=place.label
    )
    itemsize = cfg.compute_dtype.itemsize
    tier = FlattenTier(cfg.flatten_tier)
    chunks: list[tuple[int, GroupKey, list[tuple[str, nn.Parameter]]]] = []
    registration = {id(p): i for i, p in enumerate(model.parameters())}
    for key, named in grouped.items():
        # Reverse registration order approximates the order gradients become ready.
        for run in _split_by_bytes(named[::-1], cfg.reduce_bucket_bytes, itemsize):
            chunks.append((max(registration[id(p)] for _, p in run), key, run))
    chunks.sort(key=lambda c: -c[0])
    groups = tuple(
        build_flat_group(
            i,
            key,
            run,
            group=place.group(key),
            compute_dtype=cfg.compute_dtype,
            tier=tier,
            keep_grad_buffer=cfg.stage == 1,
        )
        for i, (_, key, run) in enumerate(chunks)
    )
    reducer = GradReducer(
        groups,
        stage=cfg.stage,
        reduce_dtype=cfg.grad_reduce_dtype,
        overlap=cfg.overlap,
        max_inflight=cfg.max_inflight_reductions,
    )
    return groups, reducer


def _shard_stage3(
    model: nn.Module,
    cfg: ZeroConfig,
    place: _Placement,
    param_group_of: dict[int, int],
    param_init: ParamInit,
    init_seed: int,
) -> tuple[tuple[FlatParamGroup, ...], GradReducer, Stage3Runtime]:
    """Stage 3: one sharded flat group per unit and GroupKey; hooks gather and release.

    Units still on the meta device are materialized one at a time just before they are
    sharded (partitioned init).
    """
    plans = plan_units(
        model,
        unit_modules=cfg.unit_modules,
        leaf_modules=cfg.leaf_modules,
        min_unit_params=cfg.min_unit_params,
        leaf_params_per_module=cfg.leaf_params_per_module,
    )
    groups: list[FlatParamGroup] = []
    units: list[Unit] = []
    for ui, plan in enumerate(plans):
        if is_meta(plan):
            materialize_unit(
                plan, ui, device=place.world.device, param_init=param_init, seed=init_seed
            )
        grouped = group_parameters(
            plan.params, param_group_of=param_group_of, process_group_of=place.label
        )
        ugroups = tuple(
            build_sharded_group(
                len(groups) + j, key, named, group=place.group(key), compute_dtype=cfg.compute_dtype
            )
            for j, (key, named) in enumerate(grouped.items())
        )
        groups.extend(ugroups)
        numel = sum(g.layout.numel for g in ugroups)
        # The root stays gathered: its forward wraps every other unit's, and its output
        # layer is the first thing backward needs.
        persistent = ui == 0 or numel < cfg.persistence_threshold
        units.append(Unit(ui, plan.name, plan.module, ugroups, persistent))

    def reorder(order: Sequence[Unit]) -> None:
        seen: dict[int, FlatParamGroup] = {}
        for u in [*reversed(order), *reversed(units)]:
            for g in u.groups:
                seen.setdefault(g.index, g)
        reducer.set_order(list(seen.values()))

    runtime = Stage3Runtime(
        units,
        world=place.world,
        prefetch_depth=cfg.prefetch_depth,
        prefetch_bytes=cfg.prefetch_bytes,
        max_live_bytes=cfg.max_live_bytes,
        on_new_order=reorder,
    )
    reducer = GradReducer(
        [g for u in reversed(units) for g in u.groups],
        stage=3,
        reduce_dtype=cfg.grad_reduce_dtype,
        overlap=cfg.overlap,
        max_inflight=cfg.max_inflight_reductions,
        on_complete=runtime.on_group_complete,
        on_backward_end=runtime.on_backward_end,
    )
    return tuple(groups), reducer, runtime


def initialize(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    config: ZeroConfig | Mapping[str, Any] | None = None,
    *,
    group: Group | None = None,
    process_groups: Mapping[str, Group] | None = None,
    param_init: ParamInit = reset_parameters,
    init_seed: int = 0,
) -> tuple[nn.Module, ZeroOptimizer]:
    """Shard `model`'s training state over `group` (default: the world) per `config`.

    Returns the same module (its parameters now views of flat compute-dtype buffers,
    with hooks installed) and a `ZeroOptimizer` that wraps `optimizer`, which must be
    freshly built on the model's parameters (no state yet). At stage 3 the model may be
    built on the meta device: each unit is then materialized and initialized by
    `param_init(module)` (default: `reset_parameters()`) with the generator seeded from
    `init_seed`, sharded and freed before the next, so no rank holds the whole model.

    `process_groups` maps module paths to the data-parallel group of their parameters
    when it is not the world (experts under expert parallelism: the ranks holding the
    same experts): those parameters get flat groups of their own, sharded over and
    reduced (averaged) within that group.
    """
    cfg = as_config(config)
    if hasattr(model, _ATTR):
        raise ValueError("this model was already initialized by zeroshard")
    if not torch.distributed.is_initialized():
        raise RuntimeError(
            "torch.distributed is not initialized: launch with torchrun and "
            "call torch.distributed.init_process_group() first"
        )
    timeout = timedelta(seconds=cfg.collective_timeout_s)
    everyone = (group or Group()).with_timeout(timeout)
    world, replicate = everyone, None
    if cfg.shard_group_size is not None and cfg.shard_group_size != everyone.size:
        if group is not None:
            raise ValueError("shard_group_size works on the world group; pass no group with it")
        size = cfg.shard_group_size
        if everyone.size % size:
            raise ValueError(
                f"shard_group_size {size} does not divide the world of {everyone.size} ranks"
            )
        hybrid = make_hybrid_groups(everyone.size // size, size, timeout=timeout)
        # Everything below shards over `world`, the shard group; `replicate` only averages.
        world, replicate = hybrid.shard, hybrid.replicate
        if process_groups:
            raise ValueError("process_groups and shard_group_size cannot be combined yet")
    unknown = [p for p in process_groups or {} if not _is_module_path(model, p)]
    if unknown:
        raise ValueError(f"process_groups names {unknown}, which are not module paths of the model")
    place = _Placement(
        world, {k: g.with_timeout(timeout) for k, g in (process_groups or {}).items()}
    )
    meta = [n for n, p in model.named_parameters() if p.is_meta]
    if meta and cfg.stage != 3:
        raise ValueError(
            f"parameters {meta[:3]}... are on the meta device: partitioned init "
            "needs stage 3 (or materialize the model before initialize())"
        )
    meta_buffers = [n for n, b in model.named_buffers() if b.is_meta]
    if meta_buffers:
        raise ValueError(
            f"buffers {meta_buffers} are on the meta device: materialize them "
            "before initialize() (only parameters are materialized unit by unit)"
        )
    if len(optimizer.state) != 0:
        raise ValueError(
            "the optimizer already has state: build it fresh on the model's "
            "parameters and pass it to initialize() before any step"
        )
    start = time.perf_counter()

    param_group_of: dict[int, int] = {}
    model_params = {id(p) for p in model.parameters()}
    for k, pg in enumerate(optimizer.param_groups):
        for p in pg["params"]:
            if id(p) not in model_params:
                raise ValueError(
                    f"optimizer param group {k} holds a tensor of shape "
                    f"{tuple(p.shape)} that is not a parameter of the model"
                )
            param_group_of[id(p)] = k
    scaler = None
    if cfg.compute_dtype == torch.float16:
        scaler = LossScaler(cfg.initial_loss_scale, cfg.loss_scale_window, cfg.min_loss_scale)
    if cfg.stage == 3:
        groups, reducer, runtime = _shard_stage3(
            model, cfg, place, param_group_of, param_init, init_seed
        )
        after_publish, before_step = runtime.release_all, runtime.verify_order
    else:
        groups, reducer = _flatten_stage12(model, cfg, place, param_group_of)
        runtime, after_publish, before_step = None, None, None
    offload = None
    if cfg.offload_optimizer:
        offload = HostOffload(
            choose_offloaded(groups, cfg.offload_ratio),
            world=world,
            compute_dtype=cfg.compute_dtype,
            chunk_bytes=cfg.offload_chunk_bytes,
            pin=cfg.offload_pin_memory,
            offload_params=cfg.offload_params,
        )
        _warn_unfused(optimizer)
    install_precision_hooks(model, cfg.compute_dtype, scaler)
    install_grad_guards(groups, cfg.stage)
    reducer.replicate = replicate
    reducer.offload = offload
    zopt = ZeroOptimizer(
        optimizer,
        groups,
        reducer,
        world,
        scaler,
        cfg.allgather_bucket_bytes,
        after_publish,
        before_step,
        offload,
    )
    if offload is not None:
        # The compute shards of the offloaded groups are made from the masters once here,
        # then after every step.
        offload.refresh(offload.groups)
    seconds = time.perf_counter() - start
    setattr(model, _ATTR, EngineState(cfg, world, replicate, groups, zopt, runtime, offload))
    install_state_dict_hooks(model, engine_state(model))
    if everyone.rank == 0:
        tiers = sorted({g.tier.value for g in groups})
        log.info(
            "zeroshard stage %d: %d params in %d flat groups over %d ranks, compute %s, "
            "flattened on %s in %.2fs",
            cfg.stage,
            sum(g.layout.numel for g in groups),
            len(groups),
            world.size,
            cfg.compute_dtype,
            "/".join(tiers),
            seconds,
        )
    return model, zopt


def _warn_unfused(optimizer: torch.optim.Optimizer) -> None:
    # On CPU tensors torch's foreach and for-loop optimizers run op by op with temporaries;
    # its fused CPU kernels (Adam, AdamW, SGD, Adagrad) make one pass over memory.
    if any("fused" in pg and not pg["fused"] for pg in optimizer.param_groups):
        warn_on_rank0(
            f"offload_optimizer: {type(optimizer).__name__} steps on the CPU without its "
            "fused kernel; build it with fused=True (one pass over memory) for a faster CPU step"
        )


def _is_module_path(model: nn.Module, path: str) -> bool:
    return any(name == path for name, _ in model.named_modules())


def engine_state(model: nn.Module) -> EngineState:
    """The engine state `initialize` attached to `model`."""
    state = getattr(model, _ATTR, None)
    if not isinstance(state, EngineState):
        raise ValueError("this model was not initialized with zeroshard.engine.initialize()")
    return state


def engine_stats(model: nn.Module) -> EngineStats:
    """Stage 3 counters (gathers, bytes gathered, live and peak gathered bytes, ...)."""
    runtime = engine_state(model).stage3
    if runtime is None:
        raise ValueError("engine statistics are kept for stage 3 only (stages 1/2 gather nothing)")
    return runtime.stats


@torch.no_grad()
def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The full fp32 state dict on CPU, keyed like `model.state_dict()` before wrapping.

    Collective: call it on every rank; every rank gets the whole dict. Tied parameters
    appear under each of their names, as in `state_dict()`; buffers keep their dtype.
    """
    state = engine_state(model)
    full: dict[int, torch.Tensor] = {}
    for g in state.groups:
        # Offloaded masters are on the host: they travel from the group's device.
        out = torch.empty(g.layout.padded_numel, dtype=torch.float32, device=g.group.device)
        g.group.all_gather_into(
            out, g.master.detach().to(g.group.device), label=f"state dict of group {g.index}"
        ).wait()
        for p, slot in zip(g.params, g.layout.slots, strict=True):
            full[id(p)] = out[slot.offset : slot.end].view(slot.shape).cpu().clone()
    result: dict[str, torch.Tensor] = {}
    for name, value in model.state_dict(keep_vars=True).items():
        gathered = full.get(id(value))
        result[name] = gathered if gathered is not None else value.detach().cpu().clone()
    return result
