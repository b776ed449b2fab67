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
from torch.distributed.device_mesh import DeviceMesh

from zeroshard.comm import Group, make_hybrid_groups, warn_on_rank0
from zeroshard.engine.config._config import ZeroConfig, as_config
from zeroshard.engine.runtime._flat_group import FlatParamGroup, build_flat_group
from zeroshard.engine.runtime._float8 import (
    float8_weights,
    gathered_in_float8,
    unwrap_float8_weights,
)
from zeroshard.engine.runtime._float8_gather import Float8Gather, Float8Home
from zeroshard.engine.runtime._grad_guard import install_grad_guards
from zeroshard.engine.runtime._group_home import DeviceHome, GroupHome
from zeroshard.engine.runtime._group_plan import FlatGroupPlan, PlannedFlatGroup, plan_flat_groups
from zeroshard.engine.runtime._loss_scale import LossScaler
from zeroshard.engine.runtime._names import canonical_name
from zeroshard.engine.runtime._optimizer import ZeroOptimizer, bind_masters
from zeroshard.engine.runtime._optimizers import as_optimizers, combine
from zeroshard.engine.runtime._precision import install_precision_hooks
from zeroshard.engine.runtime._reduce import GradReducer
from zeroshard.engine.runtime._stage3 import Stage3Runtime
from zeroshard.engine.runtime._state import EngineState, attach_state
from zeroshard.engine.runtime._stepper import DeviceStep, Stepper
from zeroshard.engine.runtime._tensor_parallel import SPLIT_LABEL, split_dim
from zeroshard.engine.runtime._unit_plan import UnitPlan
from zeroshard.engine.runtime._watch import ChangeWatch
from zeroshard.engine.runtime.offload._compiled_step import compile_variants
from zeroshard.engine.runtime.offload._fused_adam import fused_adam, steps_in_blocks
from zeroshard.engine.runtime.offload._host_offload import HostOffload
from zeroshard.engine.runtime.offload._plan import OffloadSizes
from zeroshard.engine.runtime.offload._step import blocked_step_refusal, delayed_step_refusal
from zeroshard.engine.runtime.offload._steppers import DelayedHostStep, HostStep
from zeroshard.engine.runtime.offload._threads import stepping_threads
from zeroshard.engine.runtime.whole._declare import steps_whole
from zeroshard.engine.runtime.whole._whole_step import WholeParams
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
from zeroshard.engine.setup._mesh import (
    MeshGroups,
    check_dtensor_params,
    check_mesh_inputs,
    mesh_groups,
)
from zeroshard.engine.setup._whole import (
    check_whole_mesh,
    check_whole_optimizers,
    whole_matrix_steppers,
)
from zeroshard.engine.state._module_state import install_state_dict_hooks
from zeroshard.partition import FlattenTier, GroupKey

log = logging.getLogger("zeroshard.engine")


@dataclass(frozen=True)
class _Placement:
    """Which process group each parameter is sharded and reduced over: with a device mesh
    its `dp` group (the parameters split over `tp` in flat groups of their own)."""

    shard_group: Group
    own: Mapping[str, Group]  # module path -> the data-parallel group of its parameters
    mesh: MeshGroups | None = None

    def label(self, name: str, param: nn.Parameter) -> str:
        """The longest module path of `own` that contains parameter `name`, or 'default'
        (with a mesh: whether `param` is split over tp)."""
        if self.mesh is not None:
            return SPLIT_LABEL if split_dim(param) is not None else "default"
        best = "default"
        for path in self.own:
            inside = name.startswith(canonical_name(path) + ".")
            if inside and (best == "default" or len(path) > len(best)):
                best = path
        return best

    def process_group(self, key: GroupKey) -> Group:
        """The process group of a GroupKey."""
        if self.mesh is not None:
            return self.mesh.data_parallel
        return self.shard_group if key.process_group == "default" else self.own[key.process_group]


@dataclass(frozen=True)
class _Homes:
    """Where the planned groups are built: CPU offload's host storage, the fp8 weights'
    gather, or the device."""

    master_dtype: torch.dtype
    offload: HostOffload | None = None
    float8: Float8Gather | None = None

    def of(self, g: PlannedFlatGroup) -> GroupHome:
        """Where planned group `g` keeps its master and what its gathers send."""
        if g.offloaded:
            assert self.offload is not None
            return self.offload.home(g.index)
        if g.float8:
            assert self.float8 is not None
            return Float8Home(self.float8, self.master_dtype)
        return DeviceHome(self.master_dtype)


def _build(
    g: PlannedFlatGroup, cfg: ZeroConfig, place: _Placement, homes: _Homes
) -> FlatParamGroup:
    """Build planned group `g` into its home."""
    return build_flat_group(
        g.index,
        g.key,
        g.named,
        g.layout,
        process_group=place.process_group(g.key),
        compute_dtype=cfg.precision.compute_dtype,
        stage=cfg.stage,
        tier=FlattenTier(cfg.flatten_tier),
        home=homes.of(g),
    )


def _shard_stage3(
    plan: FlatGroupPlan,
    cfg: ZeroConfig,
    place: _Placement,
    homes: _Homes,
    param_init: ParamInit,
    init_seed: int,
) -> list[tuple[UnitPlan, tuple[FlatParamGroup, ...]]]:
    """Stage 3: each unit's plan and its sharded flat groups (one per GroupKey).

    Units still on the meta device are materialized one at a time just before they are
    sharded (partitioned init).
    """
    units: list[tuple[UnitPlan, tuple[FlatParamGroup, ...]]] = []
    for ui, unit in enumerate(plan.units):
        if is_meta(unit):
            materialize_unit(
                unit, ui, device=place.shard_group.device, param_init=param_init, seed=init_seed
            )
        groups = tuple(_build(g, cfg, place, homes) for g in plan.groups_of(ui))
        units.append((unit, groups))
    return units


def initialize(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer],
    config: ZeroConfig | Mapping[str, Any] | None = None,
    *,
    group: Group | None = None,
    process_groups: Mapping[str, Group] | None = None,
    param_init: ParamInit = reset_parameters,
    init_seed: int = 0,
    device_mesh: DeviceMesh | None = None,
) -> tuple[nn.Module, ZeroOptimizer]:
    """Shard `model`'s training state over `group` (default: the world) per `config`.

    Returns the same module (its parameters now views of flat compute-dtype buffers,
    with hooks installed) and a `ZeroOptimizer` that wraps `optimizer`, which must be
    freshly built on the model's parameters (no state yet): one torch optimizer, or a
    sequence of them over disjoint parameters (torch.optim.Muon on the hidden matrices
    and AdamW on the rest), stepped, clipped, scheduled and saved as one. Whole-matrix
    optimizers (torch.optim.Muon, or one that declares `zeroshard_whole_params = True`)
    step each matrix whole, on one rank ([Note: whole-matrix optimizers]). At stage 3
    the model may be built on the meta device: each unit is then materialized and initialized by
    `param_init(module)` (default: `reset_parameters()`) with the generator seeded from
    `init_seed`, sharded and freed before the next, so no rank holds the whole model.

    `process_groups` maps module paths to the data-parallel group of their parameters
    when it is not the world (experts under expert parallelism: the ranks holding the
    same experts): those parameters get flat groups of their own, sharded over and
    reduced (averaged) within that group.

    `device_mesh` (dims `dp` and `tp`) takes a model that torch's tensor parallelism split
    over `device_mesh["tp"]` (`parallelize_module`): each rank's local pieces are sharded
    over `dp` and their gradients reduced over `dp`; torch's tensor-parallel collectives
    run as they are (see [Note: DTensor parameters] in runtime/_tensor_parallel.py).
    """
    cfg = as_config(config)
    check_model(model, cfg)
    optimizers = as_optimizers(optimizer)
    # Before anything reads the parameters' storage: torchao's fp8-gather subclass has none.
    unwrap_float8_weights(model, optimizers)
    check_whole_optimizers(optimizers, cfg)
    optimizer = combine(optimizers)
    refusal = delayed_step_refusal(optimizer) if cfg.offload.delay_param_update else ""
    if cfg.offload.compiled_step and not refusal:
        what = "offload.compiled_step compiles torch's Adam/AdamW update"
        refusal = blocked_step_refusal(optimizer, what)
    if refusal:
        raise ValueError(refusal)
    check_module_paths(model, process_groups or {})
    timeout = timedelta(seconds=cfg.comm.collective_timeout_s)
    everyone = (group or Group()).with_timeout(timeout)
    check_ranks_agree(everyone, describe_rank(cfg, everyone, model, optimizer, device_mesh))
    # After the agreement: a rank given no mesh (or other DTensors) would otherwise fail
    # alone while the others wait for it in the agreement's collective.
    check_mesh_inputs(model, cfg, device_mesh, group=group, process_groups=process_groups)
    check_whole_mesh(optimizers, device_mesh)
    mesh = None
    if device_mesh is not None:
        mesh = mesh_groups(device_mesh, everyone, timeout)
        check_dtensor_params(model, mesh.tensor_parallel)
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
        shard_group,
        {k: g.with_timeout(timeout) for k, g in (process_groups or {}).items()},
        mesh,
    )
    param_group_of = param_group_index(model, optimizer)
    # Before anything is flattened: [Note: one set of initial weights].
    broadcast_initial_state(
        model, everyone, place.own, None if mesh is None else mesh.data_parallel
    )
    start = time.perf_counter()
    fp8 = gathered_in_float8(model, cfg)
    if not fp8 and everyone.rank == 0 and float8_weights(model):
        log.info(
            "zeroshard: enable_fsdp_float8_all_gather: stage %d%s gathers the fp8 weights in "
            "the compute dtype (their Float8Linears cast them, as without the option)",
            cfg.stage,
            " with offload_optimizer" if cfg.stage == 3 else "",
        )
    plan = plan_flat_groups(
        model,
        cfg,
        shard_size=shard_group.size,
        size_of=lambda key: place.process_group(key).size,
        param_group_of=param_group_of,
        process_group_of=place.label,
        blocked_step=steps_in_blocks(optimizer),
        float8=fp8,
    )
    # Host storage first, so each offloaded group is built into its part of it.
    offload = None
    if plan.offload is not None:  # None only below ratio 1 with nothing trainable
        _check_offload_fits(plan, plan.offload, everyone, optimizer)
        offload = HostOffload(
            plan.offload,
            [g.index for g in plan.groups if g.offloaded],
            device=shard_group.device,
            pin=cfg.offload.pin_memory,
            compiled_step=cfg.offload.compiled_step,
        )
        _warn_unfused(optimizer)
    scaler = None
    if cfg.precision.compute_dtype == torch.float16:
        scaler = LossScaler(
            cfg.loss_scale.initial_scale,
            cfg.loss_scale.window,
            cfg.loss_scale.min_scale,
            log_skips=everyone.rank == 0,
        )
    if fp8 and not any(g.float8 for g in plan.groups):
        fp8 = {}
        if everyone.rank == 0:
            log.info(
                "zeroshard: enable_fsdp_float8_all_gather: a process group of one rank "
                "gathers nothing, so the fp8 weights gather in the compute dtype (their "
                "Float8Linears cast them: the same bits, one gather less per unit)"
            )
    stage3 = None
    homes = _Homes(
        cfg.precision.master_dtype,
        offload,
        Float8Gather(fp8, cfg.precision.compute_dtype) if fp8 else None,
    )
    if cfg.stage == 3:
        units = _shard_stage3(plan, cfg, place, homes, param_init, init_seed)
        groups = tuple(g for _, unit_groups in units for g in unit_groups)
        stage3 = Stage3Runtime(
            units,
            shard_group=shard_group,
            prefetch_depth=cfg.stage3.prefetch_depth,
            prefetch_bytes=cfg.stage3.prefetch_bytes,
            max_live_bytes=cfg.stage3.max_live_bytes,
            persistence_threshold=cfg.stage3.persistence_threshold,
        )
        if homes.float8 is not None:
            # After the runtime's hooks, so a unit is gathered before its weights are read.
            homes.float8.attach(groups, stage3.stats)
    else:
        # Stages 1/2: flat groups of about `reduce_bucket_bytes`, in gradient-ready order.
        groups = tuple(_build(g, cfg, place, homes) for g in plan.groups)
    install_precision_hooks(model, cfg.precision.compute_dtype, scaler)
    reducer = GradReducer(
        groups if stage3 is None else stage3.reduce_order(),
        stage=cfg.stage,
        reduce_dtype=cfg.precision.grad_reduce_dtype,
        overlap=cfg.comm.overlap,
        max_inflight=cfg.comm.max_inflight_reductions,
        replicate=replicate,
        events=stage3,
        stats=None if stage3 is None else stage3.stats,
    )
    install_grad_guards(groups, cfg.stage)  # after the reducer's hooks: see _grad_guard.py
    bind_masters(optimizer, groups)
    stepper, whole = _stepper(optimizers, optimizer, groups, offload, cfg)
    zopt = ZeroOptimizer(
        optimizer,
        groups,
        reducer,
        shard_group,
        scaler,
        cfg.comm.allgather_bucket_bytes,
        stepper=stepper,
        hooks=stage3,
        tensor_parallel=None if mesh is None else mesh.tensor_parallel,
        # Last: what the engine was built on ([Note: changes after initialize]).
        watch=ChangeWatch(model, groups, [optimizer, *optimizers]),
    )
    seconds = time.perf_counter() - start
    state = EngineState(
        cfg,
        shard_group,
        replicate,
        groups,
        zopt,
        stage3,
        offload,
        tensor_parallel=None if mesh is None else mesh.tensor_parallel,
        whole_params=whole,
    )
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


def _stepper(
    optimizers: Sequence[torch.optim.Optimizer],
    optimizer: torch.optim.Optimizer,
    groups: Sequence[FlatParamGroup],
    offload: HostOffload | None,
    cfg: ZeroConfig,
) -> tuple[Stepper, WholeParams | None]:
    """How the masters are stepped: on the device, or with offload on the host after
    backward (or in it), or beside the next window (delay_param_update); several
    optimizers (`optimizer` combines them) each by its own stepper, whole-matrix ones by
    theirs (and the whole parameters this rank steps, by name)."""
    if len(optimizers) > 1 or steps_whole(optimizer):
        return whole_matrix_steppers(optimizers, groups)
    if offload is None:
        return DeviceStep(optimizer), None
    if cfg.offload.delay_param_update:
        return DelayedHostStep(optimizer, offload, groups), None
    return HostStep(optimizer, offload, groups), None


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


def _check_offload_fits(
    plan: FlatGroupPlan,
    sizes: OffloadSizes,
    everyone: Group,
    optimizer: torch.optim.Optimizer,
) -> None:
    """Raise on every rank before allocating if a host cannot hold the offloaded state."""
    floats = _state_floats(optimizer)
    state = (
        4 * floats * sum(g.layout.shard_numel for g in plan.groups if g.offloaded and g.trainable)
    )
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
