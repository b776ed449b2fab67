"""`initialize()`: shard a model and its optimizer over a process group (orchestration only)."""

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
from zeroshard.engine.config._config import ZeroConfig, as_config
from zeroshard.engine.runtime._bucket_plan import plan_buckets
from zeroshard.engine.runtime._flat_group import FlatParamGroup, build_flat_group
from zeroshard.engine.runtime._grad_guard import install_grad_guards
from zeroshard.engine.runtime._host_adam import fused_adam, steps_in_blocks
from zeroshard.engine.runtime._host_kernel import compile_variants
from zeroshard.engine.runtime._host_threads import stepping_threads
from zeroshard.engine.runtime._loss_scale import LossScaler
from zeroshard.engine.runtime._names import canonical_name, named_parameters
from zeroshard.engine.runtime._offload import HostOffload
from zeroshard.engine.runtime._offload_plan import choose_offloaded, offload_sizes
from zeroshard.engine.runtime._offload_step import blocked_step_refusal, delayed_step_refusal
from zeroshard.engine.runtime._optimizer import ZeroOptimizer
from zeroshard.engine.runtime._precision import install_precision_hooks
from zeroshard.engine.runtime._reduce import GradReducer
from zeroshard.engine.runtime._stage3 import Stage3Runtime
from zeroshard.engine.runtime._state import EngineState, attach_state
from zeroshard.engine.runtime._unit_plan import UnitPlan, plan_units
from zeroshard.engine.setup._agreement import (
    check_ranks_agree,
    describe_rank,
    raise_if_any_failed,
)
from zeroshard.engine.setup._broadcast import broadcast_initial_state
from zeroshard.engine.setup._checks import check_model, check_module_paths, param_group_index
from zeroshard.engine.setup._host_memory import check_host_memory
from zeroshard.engine.setup._materialize import (
    ParamInit,
    is_meta,
    materialize_unit,
    reset_parameters,
)
from zeroshard.engine.state._module_state import install_state_dict_hooks
from zeroshard.partition import FlattenTier, GroupKey, group_parameters

log = logging.getLogger("zeroshard.engine")


@dataclass(frozen=True)
class _Placement:
    """Which process group each parameter is sharded and reduced over."""

    shard_group: Group
    own: Mapping[str, Group]  # module path -> the data-parallel group of its parameters

    def label(self, name: str, param: nn.Parameter) -> str:
        """The longest module path of `own` that contains parameter `name`, or 'default'."""
        best = "default"
        for path in self.own:
            inside = name.startswith(canonical_name(path) + ".")
            if inside and (best == "default" or len(path) > len(best)):
                best = path
        return best

    def process_group(self, key: GroupKey) -> Group:
        """The process group of a GroupKey."""
        return self.shard_group if key.process_group == "default" else self.own[key.process_group]


def _flatten_stage12(
    model: nn.Module, cfg: ZeroConfig, place: _Placement, param_group_of: dict[int, int]
) -> tuple[FlatParamGroup, ...]:
    """Stages 1/2: flat groups of about `reduce_bucket_bytes`, in gradient-ready order."""
    grouped = group_parameters(
        named_parameters(model), param_group_of=param_group_of, process_group_of=place.label
    )
    buckets = plan_buckets(
        model, grouped, cfg.comm.reduce_bucket_bytes, cfg.precision.compute_dtype.itemsize
    )
    tier = FlattenTier(cfg.flatten_tier)
    return tuple(
        build_flat_group(
            i,
            key,
            run,
            process_group=place.process_group(key),
            compute_dtype=cfg.precision.compute_dtype,
            stage=cfg.stage,
            tier=tier,
        )
        for i, (key, run) in enumerate(buckets)
    )


def _shard_stage3(
    model: nn.Module,
    cfg: ZeroConfig,
    place: _Placement,
    param_group_of: dict[int, int],
    param_init: ParamInit,
    init_seed: int,
) -> list[tuple[UnitPlan, tuple[FlatParamGroup, ...]]]:
    """Stage 3: each unit's plan and its sharded flat groups (one per GroupKey).

    Units still on the meta device are materialized one at a time just before they are
    sharded (partitioned init).
    """
    plans = plan_units(model, cfg.stage3)
    tier = FlattenTier(cfg.flatten_tier)
    count = 0
    units: list[tuple[UnitPlan, tuple[FlatParamGroup, ...]]] = []
    for ui, plan in enumerate(plans):
        if is_meta(plan):
            materialize_unit(
                plan, ui, device=place.shard_group.device, param_init=param_init, seed=init_seed
            )
        grouped = group_parameters(
            plan.params, param_group_of=param_group_of, process_group_of=place.label
        )
        groups = tuple(
            build_flat_group(
                count + j,
                key,
                named,
                process_group=place.process_group(key),
                compute_dtype=cfg.precision.compute_dtype,
                stage=3,
                tier=tier,
            )
            for j, (key, named) in enumerate(grouped.items())
        )
        count += len(groups)
        units.append((plan, groups))
    return units


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
    check_model(model, cfg)
    refusal = delayed_step_refusal(optimizer) if cfg.offload.delay_param_update else ""
    if cfg.offload.compiled_step and not refusal:
        what = "offload.compiled_step compiles torch's Adam/AdamW update"
        refusal = blocked_step_refusal(optimizer, what)
    if refusal:
        raise ValueError(refusal)
    check_module_paths(model, process_groups or {})
    timeout = timedelta(seconds=cfg.comm.collective_timeout_s)
    everyone = (group or Group()).with_timeout(timeout)
    check_ranks_agree(everyone, describe_rank(cfg, everyone, model, optimizer))
    shard_group, replicate = everyone, None
    if cfg.shard_group_size is not None and cfg.shard_group_size != everyone.size:
        if group is not None:
            raise ValueError("shard_group_size works on the world group; pass no group with it")
        size = cfg.shard_group_size
        if everyone.size % size:
            raise ValueError(
                f"shard_group_size {size} does not divide the world of {everyone.size} ranks"
            )
        hybrid = make_hybrid_groups(everyone.size // size, size, timeout=timeout)
        # Everything below shards over `shard_group`; `replicate` only averages.
        shard_group, replicate = hybrid.shard, hybrid.replicate
        if process_groups:
            raise ValueError("process_groups and shard_group_size cannot be combined yet")
    if cfg.offload.compiled_step:
        # After the checks above, which fail at once; this may take a minute.
        _compile_host_step(everyone, optimizer, cfg)
    place = _Placement(
        shard_group, {k: g.with_timeout(timeout) for k, g in (process_groups or {}).items()}
    )
    param_group_of = param_group_index(model, optimizer)
    # Before anything is flattened: [Note: one set of initial weights].
    broadcast_initial_state(model, everyone, place.own)
    start = time.perf_counter()

    scaler = None
    if cfg.precision.compute_dtype == torch.float16:
        scaler = LossScaler(
            cfg.loss_scale.initial_scale, cfg.loss_scale.window, cfg.loss_scale.min_scale
        )
        scaler.log_skips = everyone.rank == 0
    runtime = None
    if cfg.stage == 3:
        units = _shard_stage3(model, cfg, place, param_group_of, param_init, init_seed)
        groups = tuple(g for _, unit_groups in units for g in unit_groups)
        runtime = Stage3Runtime(
            units,
            shard_group=shard_group,
            prefetch_depth=cfg.stage3.prefetch_depth,
            prefetch_bytes=cfg.stage3.prefetch_bytes,
            max_live_bytes=cfg.stage3.max_live_bytes,
            persistence_threshold=cfg.stage3.persistence_threshold,
        )
    else:
        groups = _flatten_stage12(model, cfg, place, param_group_of)
    offload = None
    chosen = _offloaded_groups(groups, cfg) if cfg.offload.optimizer else []
    if chosen:  # empty only below ratio 1 with nothing trainable
        _check_offload_fits(chosen, cfg, shard_group, everyone, optimizer)
        offload = HostOffload(
            chosen,
            shard_group=shard_group,
            compute_dtype=cfg.precision.compute_dtype,
            chunk_bytes=cfg.offload.chunk_bytes,
            reduce_dtype=cfg.precision.grad_reduce_dtype,
            pin=cfg.offload.pin_memory,
            offload_params=cfg.offload.params,
            blocked_step=steps_in_blocks(optimizer),
            compiled_step=cfg.offload.compiled_step,
        )
        _warn_unfused(optimizer)
    install_precision_hooks(model, cfg.precision.compute_dtype, scaler)
    reducer = GradReducer(
        groups if runtime is None else runtime.reduce_order(),
        stage=cfg.stage,
        reduce_dtype=cfg.precision.grad_reduce_dtype,
        overlap=cfg.comm.overlap,
        max_inflight=cfg.comm.max_inflight_reductions,
        replicate=replicate,
        offload=offload,
        events=runtime,
        stats=None if runtime is None else runtime.stats,
    )
    install_grad_guards(groups, cfg.stage)  # after the reducer's hooks: see _grad_guard.py
    zopt = ZeroOptimizer(
        optimizer,
        groups,
        reducer,
        shard_group,
        scaler,
        cfg.comm.allgather_bucket_bytes,
        hooks=runtime,
        offload=offload,
        delay_param_update=cfg.offload.delay_param_update,
    )
    if offload is not None:
        # The compute shards of the offloaded groups are made from the masters once here,
        # then after every step.
        offload.refresh(offload.groups)
    seconds = time.perf_counter() - start
    state = EngineState(cfg, shard_group, replicate, groups, zopt, runtime, offload)
    attach_state(model, state)
    install_state_dict_hooks(model, state)
    if everyone.rank == 0:
        tiers = sorted({g.tier.value for g in groups})
        log.info(
            "zeroshard stage %d: %d params in %d flat groups over %d ranks, compute %s, "
            "flattened on %s in %.2fs",
            cfg.stage,
            sum(g.layout.numel for g in groups),
            len(groups),
            shard_group.size,
            cfg.precision.compute_dtype,
            "/".join(tiers),
            seconds,
        )
    return model, zopt


# fp32 state tensors per parameter element of torch's optimizers that keep a fixed number.
_STATE_FLOATS = {"Adam": 2, "AdamW": 2, "Adamax": 2, "NAdam": 2, "RAdam": 2, "Adagrad": 1}


def _state_floats(optimizer: torch.optim.Optimizer) -> int:
    """fp32 optimizer state per master element; 2 (Adam's) for optimizers not known here."""
    name = type(optimizer).__name__
    if name == "SGD":
        return int(any(pg.get("momentum", 0) for pg in optimizer.param_groups))
    if name == "RMSprop":
        pgs = optimizer.param_groups
        return 1 + any(pg.get("centered") for pg in pgs) + any(pg.get("momentum") for pg in pgs)
    return _STATE_FLOATS.get(name, 2)


def _offloaded_groups(groups: Sequence[FlatParamGroup], cfg: ZeroConfig) -> list[FlatParamGroup]:
    """The groups `cfg.offload.ratio` sends to the host (see `choose_offloaded`)."""
    chosen = choose_offloaded(
        [g.layout.shard_numel for g in groups],
        [g.trainable for g in groups],
        cfg.offload.ratio,
        registration_order=cfg.stage == 3,
    )
    return [groups[i] for i in chosen]


def _check_offload_fits(
    chosen: list[FlatParamGroup],
    cfg: ZeroConfig,
    shard_group: Group,
    everyone: Group,
    optimizer: torch.optim.Optimizer,
) -> None:
    """Raise on every rank before allocating if a host cannot hold the offloaded state."""
    sizes = offload_sizes(
        [g.layout.shard_numel for g in chosen],
        shard_group.size,
        chunk_bytes=cfg.offload.chunk_bytes,
        compute_dtype=cfg.precision.compute_dtype,
        reduce_dtype=cfg.precision.grad_reduce_dtype,
        offload_params=cfg.offload.params,
        blocked_step=steps_in_blocks(optimizer),
    )
    floats = _state_floats(optimizer)
    state = 4 * floats * sum(g.layout.shard_numel for g in chosen if g.trainable)
    what = (
        f"the offloaded state: {sizes.host_bytes:,} bytes of masters, gradients and staging "
        f"and {state:,} of {type(optimizer).__name__} state ({floats} fp32 per element)"
    )
    check_host_memory(everyone, sizes.host_bytes + state, what)


def _compile_host_step(world: Group, optimizer: torch.optim.Optimizer, cfg: ZeroConfig) -> None:
    """Compile offload.compiled_step's kernels now ([Note: compiled host step]): on every
    rank, failing initialize on all of them if one cannot (no working C++ compiler)."""
    adams = [fused_adam(optimizer, k) for k in range(len(optimizer.param_groups))]
    if world.rank == 0:
        log.info("offload.compiled_step: compiling the host step (once per process)")
    error: Exception | None = None
    try:
        grads = {cfg.precision.grad_reduce_dtype, torch.float32}
        threads = {torch.get_num_threads()}
        if world.device.type == "cuda":
            # The stepping thread's share while groups step beside the main thread.
            threads.add(stepping_threads(torch.get_num_threads()))
        # Only with offload_params does the step write the compute-dtype cast (else the
        # device casts the masters: [Note: offload upload]).
        out = cfg.precision.compute_dtype if cfg.offload.params else None
        compile_variants([a for a in adams if a is not None], grads, out, threads)
    except Exception as e:  # whatever inductor raises: every rank must hear of it
        error = e
    what = (
        "offload.compiled_step (offload_compiled_step): compiling the host step with "
        "torch.compile's CPU backend (it needs a working C++ compiler, $CXX else g++: "
        "install one or turn the option off)"
    )
    raise_if_any_failed(world, what, error)


def _warn_unfused(optimizer: torch.optim.Optimizer) -> None:
    # On CPU tensors torch's foreach and for-loop optimizers run op by op with temporaries;
    # its fused CPU kernels (Adam, AdamW, SGD, Adagrad) make one pass over memory.
    if any("fused" in pg and not pg["fused"] for pg in optimizer.param_groups):
        warn_on_rank0(
            f"offload_optimizer: {type(optimizer).__name__} steps on the CPU without its "
            "fused kernel; build it with fused=True (one pass over memory) for a faster CPU step"
        )
