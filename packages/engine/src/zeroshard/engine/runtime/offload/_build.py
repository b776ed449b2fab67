"""CPU offload as `initialize` composes it: its refusals, its share of the plan, its host
storage (the homes of the offloaded groups) and the stepper of an optimizer whose groups
it holds."""

from __future__ import annotations

import functools
import logging
from collections.abc import Sequence

import torch

from zeroshard.comm import Agreement, Group, warn_on_rank0
from zeroshard.engine.config._config import ZeroConfig
from zeroshard.engine.runtime._flat_group import FlatParamGroup
from zeroshard.engine.runtime._group_plan import FlatGroupPlan
from zeroshard.engine.runtime._home import HomeKind
from zeroshard.engine.runtime._host_memory import check_host_memory
from zeroshard.engine.runtime._optimizer_state import state_floats_by_param_group
from zeroshard.engine.runtime._stepper import Stepper
from zeroshard.engine.runtime.offload._compiled_step import compile_variants
from zeroshard.engine.runtime.offload._fused_adam import fused_adam, steps_in_blocks
from zeroshard.engine.runtime.offload._host_offload import HostOffload
from zeroshard.engine.runtime.offload._plan import OffloadSizes, place_offloaded
from zeroshard.engine.runtime.offload._step import blocked_step_refusal, delayed_step_refusal
from zeroshard.engine.runtime.offload._steppers import DelayedHostStep, HostStep
from zeroshard.engine.runtime.offload._threads import stepping_threads
from zeroshard.engine.runtime.whole import owned_host_state

log = logging.getLogger("zeroshard.engine")


def check_offload(
    optimizers: Sequence[torch.optim.Optimizer],
    cfg: ZeroConfig,
    whole: Sequence[torch.optim.Optimizer] = (),
) -> None:
    """Refuse, before any collective, what the host steps of `cfg.offload` cannot run;
    `whole`: those of `optimizers` that step whole matrices with steppers of their own (a
    delayed step leaves them to `step()`: [Note: delayed parameter update])."""
    if not cfg.offload.optimizer:
        return
    for o in optimizers:
        delayed = cfg.offload.delay_param_update and all(o is not w for w in whole)
        refusal = delayed_step_refusal(o) if delayed else ""
        if cfg.offload.compiled_step and not refusal:
            what = "offload.compiled_step compiles torch's Adam/AdamW update"
            refusal = blocked_step_refusal(o, what)
        if refusal:
            raise ValueError(refusal)


def compile_host_step(
    world: Group, optimizers: Sequence[torch.optim.Optimizer], cfg: ZeroConfig
) -> None:
    """offload.compiled_step: compile its kernels now ([Note: compiled host step]), on
    every rank, failing on all of them if one cannot (no working C++ compiler)."""
    adams = [fused_adam(o, k) for o in optimizers for k in range(len(o.param_groups))]
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
        # device casts the masters: [Note: offload upload]), and not where the masters are
        # in the compute dtype: they are the host shards then (ShardUpload.target).
        masters = cfg.precision.master_dtype
        compute = cfg.precision.compute_dtype
        out = compute if cfg.offload.params and compute != masters else None
        compile_variants([a for a in adams if a is not None], grads, out, threads, masters)
    except Exception as e:  # whatever inductor raises: every rank must hear of it
        error = e
    what = (
        "offload.compiled_step (offload_compiled_step): compiling the host step with "
        "torch.compile's CPU backend (it needs a working C++ compiler, $CXX else g++: "
        "install one or turn the option off)"
    )
    Agreement(world).outcome(error, what)


def plan_offload(
    plan: FlatGroupPlan,
    cfg: ZeroConfig,
    shard_size: int,
    optimizers: Sequence[torch.optim.Optimizer],
) -> tuple[FlatGroupPlan, OffloadSizes | None]:
    """`plan` with the groups CPU offload takes living on the host, and what the host
    allocates for them on each of `shard_size` ranks (None: nothing offloaded)."""
    blocked = all(steps_in_blocks(o) for o in optimizers)
    return place_offloaded(plan, cfg, shard_size, blocked_step=blocked)


def build_host_storage(
    plan: FlatGroupPlan,
    sizes: OffloadSizes,
    cfg: ZeroConfig,
    world: Group,
    optimizers: Sequence[torch.optim.Optimizer],
    shard_group: Group,
) -> HostOffload:
    """The host storage of `plan`'s offloaded groups (sharded over `shard_group`), once
    every host is known to hold it with the optimizers' state (the same error on every
    rank otherwise, before anything is allocated)."""
    on_host = [g for g in plan.groups if g.home is HomeKind.HOST]
    # torch's optimizers keep their state in the master's dtype; a whole-parameter one
    # keeps none on the shards, but that of the matrices this rank owns, as the planner
    # measures it ([Note: a declared optimizer's state, measured]).
    dtype = cfg.precision.master_dtype
    owned = owned_host_state(plan.groups, optimizers, dtype, shard_group.rank)
    floats = state_floats_by_param_group(list(optimizers))
    # Each param group's optimizer (by its index in `optimizers`).
    which = [i for i, o in enumerate(optimizers) for _ in o.param_groups]
    state = [0] * len(optimizers)
    for k, n in owned.items():
        state[which[k]] += n
    for g in (g for g in on_host if g.trainable and g.key.param_group not in owned):
        k = g.key.param_group
        state[which[k]] += dtype.itemsize * floats[k] * g.layout.shard_numel
    precision = "fp32" if dtype.itemsize == 4 else "bf16"
    kinds = []
    for i, o in enumerate(optimizers):
        ks = [k for k, j in enumerate(which) if j == i]
        if any(k in owned for k in ks):
            how = "measured on the matrices this rank owns"
        else:
            how = "/".join(str(n) for n in sorted({floats[k] for k in ks})) + " per element"
            how += f" in {precision}"
        kinds.append(f"{type(o).__name__} {state[i]:,}: {how}")
    # The gradients held until step() and the staging slots are checked when they are
    # first needed: under step_in_backward without accumulation the first never are, else
    # without accumulation the second never are ([Note: offload host memory]).
    host = sizes.host_bytes(grads_held=False, staged=False)
    what = (
        f"the offloaded state: {host:,} bytes of masters and staging "
        f"and {sum(state):,} of optimizer state ({'; '.join(kinds)})"
    )
    check_host_memory(world, host + sum(state), what)
    storage = HostOffload(
        sizes,
        [g.index for g in on_host],
        device=shard_group.device,
        pin=cfg.offload.pin_memory,
        check=functools.partial(check_host_memory, world),
        compiled_step=cfg.offload.compiled_step,
    )
    _warn_unfused(optimizers)
    return storage


def host_stepper(
    optimizers: Sequence[tuple[torch.optim.Optimizer, Sequence[FlatParamGroup]]],
    storage: HostOffload,
    cfg: ZeroConfig,
) -> Stepper:
    """How `optimizers` (each with its own flat groups, some of them on the host) step:
    after backward (or in it), or beside the next window (`delay_param_update`); each
    group with the optimizer that owns it, in one schedule (one upload round)."""
    if cfg.offload.delay_param_update:
        return DelayedHostStep(optimizers, storage)
    return HostStep(optimizers, storage)


def _warn_unfused(optimizers: Sequence[torch.optim.Optimizer]) -> None:
    # On CPU tensors torch's foreach and for-loop optimizers run op by op with temporaries;
    # its fused CPU kernels (Adam, AdamW, SGD, Adagrad) make one pass over memory.
    for o in optimizers:
        if any("fused" in pg and not pg["fused"] for pg in o.param_groups):
            warn_on_rank0(
                f"offload_optimizer: {type(o).__name__} steps on the CPU without its "
                "fused kernel; build it with fused=True (one pass over memory) for a faster "
                "CPU step"
            )
