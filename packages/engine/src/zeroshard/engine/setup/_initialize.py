"""`initialize()`: shard a model and its optimizer over a process group.

It reads as the order the parts are composed in: the inputs checked and agreed on by
every rank, where each parameter is sharded (`Placement`), the initial weights made one,
the flat groups planned (how each travels, where each lives), the homes and wires built,
the groups built into them (stage 3: unit by unit), the reducer, one stepper per
optimizer, the optimizer; each part a short builder of its own module or feature face.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from datetime import timedelta
from typing import Any, overload

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from zeroshard.comm import Group
from zeroshard.engine.config._config import ZeroConfig, as_config
from zeroshard.engine.runtime._flat_group import FlatParamGroup
from zeroshard.engine.runtime._float8 import unwrap_float8_weights
from zeroshard.engine.runtime._grad_guard import install_grad_guards, refuse_backward
from zeroshard.engine.runtime._loss_scale import LossScaler
from zeroshard.engine.runtime._optimizer import ZeroOptimizer, bind_masters
from zeroshard.engine.runtime._optimizers import as_optimizers, combine
from zeroshard.engine.runtime._precision import install_precision_hooks
from zeroshard.engine.runtime._reduce import GradReducer
from zeroshard.engine.runtime._stage3 import Stage3Runtime
from zeroshard.engine.runtime._state import EngineState, attach_state
from zeroshard.engine.runtime._stats import EngineStats
from zeroshard.engine.runtime._stepper import WholeParams
from zeroshard.engine.runtime._tensor_parallel import TensorParallel
from zeroshard.engine.runtime._watch import ChangeWatch
from zeroshard.engine.runtime.offload import check_offload, compile_host_step
from zeroshard.engine.runtime.whole import (
    WholeMatrices,
    steps_whole,
)
from zeroshard.engine.setup._agreement import check_ranks_agree, describe_rank
from zeroshard.engine.setup._broadcast import broadcast_initial_state
from zeroshard.engine.setup._build import GroupsPlan, build_groups, plan_groups
from zeroshard.engine.setup._checks import (
    check_divide_factor,
    check_evaluation_config,
    check_evaluation_factor,
    check_model,
    check_module_paths,
    param_group_index,
)
from zeroshard.engine.setup._materialize import ParamInit, reset_parameters
from zeroshard.engine.setup._mesh import check_mesh_inputs
from zeroshard.engine.setup._placement import Placement, place
from zeroshard.engine.setup._steppers import build_steppers
from zeroshard.engine.state._module_state import install_state_dict_hooks

log = logging.getLogger("zeroshard.engine")


@overload
def initialize(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer],
    config: ZeroConfig | Mapping[str, Any] | None = None,
    *,
    group: Group | None = None,
    process_groups: Mapping[str, Group] | None = None,
    gradient_divide_factor: float | None = None,
    param_init: ParamInit = reset_parameters,
    init_seed: int = 0,
    device_mesh: DeviceMesh | None = None,
) -> tuple[nn.Module, ZeroOptimizer]: ...


@overload
def initialize(
    model: nn.Module,
    optimizer: None,
    config: ZeroConfig | Mapping[str, Any] | None = None,
    *,
    group: Group | None = None,
    process_groups: Mapping[str, Group] | None = None,
    gradient_divide_factor: float | None = None,
    param_init: ParamInit = reset_parameters,
    init_seed: int = 0,
    device_mesh: DeviceMesh | None = None,
) -> tuple[nn.Module, None]: ...


def initialize(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer] | None,
    config: ZeroConfig | Mapping[str, Any] | None = None,
    *,
    group: Group | None = None,
    process_groups: Mapping[str, Group] | None = None,
    gradient_divide_factor: float | None = None,
    param_init: ParamInit = reset_parameters,
    init_seed: int = 0,
    device_mesh: DeviceMesh | None = None,
) -> tuple[nn.Module, ZeroOptimizer | None]:
    """Shard `model`'s training state over `group` (default: the world) per `config`.

    Returns the same module (its parameters now views of flat compute-dtype buffers,
    with hooks installed) and a `ZeroOptimizer` that wraps `optimizer`, which must be
    freshly built on the model's parameters (no state yet): one torch optimizer, or a
    sequence of them over disjoint parameters (torch.optim.Muon on the hidden matrices
    and AdamW on the rest), stepped, clipped, scheduled and saved as one. With
    `optimizer=None` the model is sharded for evaluation only and None comes back in the
    optimizer's place: forward, `load_checkpoint(model, None, path)` (the weights),
    `full_state_dict` and `gathered_parameters` work; a backward that reaches a
    trainable parameter, and what needs the optimizer, raise (docs/config.md). Whole-matrix
    optimizers (torch.optim.Muon, or one that declares `zeroshard_whole_params = True`)
    step each matrix whole, on one rank ([Note: whole-matrix optimizers]). At stage 3
    the model may be built on the meta device: each unit is then materialized and initialized by
    `param_init(module)` (default: `reset_parameters()`) with the generator seeded from
    `init_seed`, sharded and freed before the next, so no rank holds the whole model.

    `process_groups` maps module paths to the data-parallel group of their parameters
    when it is not the world (experts under expert parallelism: the ranks holding the
    same experts): those parameters get flat groups of their own, sharded over and
    reduced (averaged) within that group, beside hybrid sharding (a group may cross the
    shard groups) and a device mesh (a group holds ranks of one tp coordinate) alike.
    `gradient_divide_factor` (with `process_groups`) divides those groups' summed
    gradients by it instead of their size: the whole data-parallel world for experts fed
    by an all-to-all, as DeepSpeed MoE and FSDP2's `set_gradient_divide_factor` do.

    `device_mesh` (dims `dp` and `tp`, or `dp_replicate`, `dp_shard` and `tp` for hybrid
    sharding) takes a model that torch's tensor parallelism split over
    `device_mesh["tp"]` (`parallelize_module`): each rank's local pieces are sharded over
    `dp` (`dp_shard`) and their gradients reduced over it (and averaged over
    `dp_replicate`); torch's tensor-parallel collectives run as they are (see [Note:
    DTensor parameters] in runtime/_tensor_parallel.py).
    """
    # 1. The inputs, checked where every rank fails alike (no collective yet).
    cfg = as_config(config)
    check_model(model, cfg)
    if optimizer is None:
        check_evaluation_config(cfg)
    optimizers = [] if optimizer is None else as_optimizers(optimizer, model)
    # Before anything reads the parameters' storage: torchao's fp8-gather subclass has none.
    unwrap_float8_weights(model, optimizers)
    check_offload(optimizers, cfg, whole=[o for o in optimizers if steps_whole(o)])
    inner = combine(optimizers) if optimizers else None
    check_module_paths(model, process_groups or {})
    check_divide_factor(gradient_divide_factor, process_groups or {})
    # 2. Every rank agrees on them, then on where each parameter is sharded.
    timeout = timedelta(seconds=cfg.comm.collective_timeout_s)
    everyone = (group or Group()).with_timeout(timeout)
    factor = None if gradient_divide_factor is None else float(gradient_divide_factor)
    described = describe_rank(cfg, everyone, model, inner, device_mesh)
    # The factor before the model's fields, which run to each rank's own length: after
    # them, a model with an extra layer would pair it against the factor.
    check_ranks_agree(everyone, [("gradient_divide_factor", repr(factor)), *described])
    if optimizer is None:
        # After the agreement: a rank given no optimizer beside ranks given one is named
        # by it on every rank, not refused here alone while the others wait for it.
        check_evaluation_factor(factor)
    # After the agreement: a rank given no mesh (or other DTensors) would otherwise fail
    # alone while the others wait for it in the agreement's collective.
    check_mesh_inputs(model, cfg, device_mesh, group=group)
    placement = place(
        model,
        cfg,
        everyone,
        group=group,
        process_groups=process_groups,
        device_mesh=device_mesh,
        timeout=timeout,
        gradient_divide_factor=factor,
    )
    if cfg.offload.compiled_step:
        # After the checks above, which fail at once; this may take a minute.
        compile_host_step(everyone, optimizers, cfg)
    param_group_of = None if inner is None else param_group_index(model, inner)
    # 3. One set of initial weights, before anything is flattened.
    mesh = placement.mesh
    if mesh is None:
        broadcast_initial_state(model, everyone, placement.own)
    else:
        tp = mesh.tensor_parallel.group if placement.own else None
        broadcast_initial_state(model, everyone, placement.own, mesh.pieces, tp)
    start = time.perf_counter()
    # 4. The plan (how each group travels, where it lives), then the groups built into
    # their homes with their wires.
    stats = EngineStats()
    planned = plan_groups(model, cfg, placement, everyone, optimizers, param_group_of, stats)
    groups, stage3 = build_groups(
        planned, cfg, placement, stats, param_init=param_init, init_seed=init_seed
    )
    # 5. Gradients in, the step, parameters out (without an optimizer: none of them).
    scaler = None if inner is None else _loss_scaler(cfg, everyone)
    install_precision_hooks(model, cfg.precision.compute_dtype, scaler)
    tensor_parallel = None if mesh is None else mesh.tensor_parallel
    zopt, whole = None, None
    if inner is None:
        refuse_backward(groups)
        ChangeWatch(model, groups, [])  # the model's own hook holds it
    else:
        zopt, whole = _zero_optimizer(
            model, inner, optimizers, groups, stage3, planned, placement, scaler, stats, cfg
        )
    state = EngineState(
        cfg,
        placement.shard_group,
        placement.replicate,
        groups,
        zopt,
        stage3,
        tensor_parallel=tensor_parallel,
        whole_params=whole,
    )
    attach_state(model, state)
    install_state_dict_hooks(model, state)
    if everyone.rank == 0:
        _log_built(state, time.perf_counter() - start)
    return model, zopt


def _zero_optimizer(
    model: nn.Module,
    inner: torch.optim.Optimizer,
    optimizers: Sequence[torch.optim.Optimizer],
    groups: tuple[FlatParamGroup, ...],
    stage3: Stage3Runtime | None,
    planned: GroupsPlan,
    placement: Placement,
    scaler: LossScaler | None,
    stats: EngineStats,
    cfg: ZeroConfig,
) -> tuple[ZeroOptimizer, WholeParams | None]:
    """The reducer, the steppers and the `ZeroOptimizer` over them, and what whole-matrix
    optimizers step whole by name."""
    reducer = _reducer(cfg, groups, stage3, placement.replicate, stats)
    install_grad_guards(groups, cfg.stage)  # after the reducer's hooks: see _grad_guard.py
    mesh = placement.mesh
    tensor_parallel: TensorParallel | None = None if mesh is None else mesh.tensor_parallel
    # The whole-matrix optimizers' owners and whole parameters, then every param group
    # bound once (to those, or to the masters), then the steppers built on what is bound.
    whole = (
        WholeMatrices(optimizers, groups, tensor_parallel, cfg.offload.pin_memory)
        if any(map(steps_whole, optimizers))
        else None
    )
    bind_masters(inner, groups, {} if whole is None else whole.bound)
    stepper = build_steppers(optimizers, groups, planned.host, cfg, whole)
    zopt = ZeroOptimizer(
        inner,
        groups,
        reducer,
        placement.shard_group,
        scaler,
        cfg.comm.allgather_bucket_bytes,
        stepper=stepper,
        hooks=stage3,
        tensor_parallel=tensor_parallel,
        replicate=placement.replicate if placement.own_crosses_replicas else None,
        # Last: what the engine was built on ([Note: changes after initialize]).
        watch=ChangeWatch(model, groups, [inner, *optimizers]),
    )
    return zopt, None if whole is None else whole.params


def _reducer(
    cfg: ZeroConfig,
    groups: tuple[FlatParamGroup, ...],
    stage3: Stage3Runtime | None,
    replicate: Group | None,
    stats: EngineStats,
) -> GradReducer:
    """The reducer of `groups` (at stage 3 in the runtime's launch order, which it hears)."""
    return GradReducer(
        groups if stage3 is None else stage3.reduce_order(),
        stage=cfg.stage,
        reduce_dtype=cfg.precision.grad_reduce_dtype,
        overlap=cfg.comm.overlap,
        max_inflight=cfg.comm.max_inflight_reductions,
        replicate=replicate,
        events=stage3,
        stats=None if stage3 is None else stats,
    )


def _log_built(state: EngineState, seconds: float) -> None:
    """One line on what was built, and how long the flattening took."""
    groups = state.groups
    log.info(
        "zeroshard stage %d: %d params in %d flat groups over %d ranks, compute %s, "
        "flattened on %s in %.2fs",
        state.config.stage,
        sum(g.layout.numel for g in groups),
        len(groups),
        state.shard_group.size,
        state.config.precision.compute_dtype,
        "/".join(sorted({g.tier.value for g in groups})),
        seconds,
    )


def _loss_scaler(cfg: ZeroConfig, everyone: Group) -> LossScaler | None:
    """fp16's dynamic loss scaler (None in another compute dtype)."""
    if cfg.precision.compute_dtype != torch.float16:
        return None
    return LossScaler(
        cfg.loss_scale.initial_scale,
        cfg.loss_scale.window,
        cfg.loss_scale.min_scale,
        log_skips=everyone.rank == 0,
    )
