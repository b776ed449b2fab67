"""`estimate()`: per-rank memory and step time of a run, from a model on the meta device.

Model states come from the flat groups `initialize()` would build (`_groups`),
activations from one meta-device micro-batch (`_activations`), the step time
from a measured compute figure and a bandwidth model (`_step_time`). The peak is the
larger of two moments: backward (states, activations and the gradient path as measured,
plus the stage-3 units gathered at once) and the optimizer step (states, all gradient
shards, stages 1/2's parameter all-gather in flight, and a whole-matrix optimizer's
scratch: [Note: the whole-matrix step's scratch] in _whole.py).
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from zeroshard.engine.config._config import ZeroConfig, as_config
from zeroshard.engine.planner._activations import (
    GradPath,
    LossFn,
    OperatorTrace,
    default_loss,
    trace_operators,
)
from zeroshard.engine.planner._cluster import Cluster
from zeroshard.engine.planner._groups import (
    GroupPlan,
    grad_shard_bytes,
    host_bytes,
    host_state_bytes,
    plan_groups,
    snapshot_bytes,
    snapshot_host_bytes,
    state_bytes,
    state_rows,
)
from zeroshard.engine.planner._step_time import (
    Compute,
    StepTime,
    check_step_in_backward,
    project_step,
)
from zeroshard.engine.planner._whole import (
    WholeMatrixCost,
    owner_state_groups,
    whole_matrix_cost,
)
from zeroshard.engine.runtime._float8 import unwrap_float8_weights
from zeroshard.engine.runtime._optimizer_state import state_floats_by_param_group
from zeroshard.engine.runtime._optimizers import as_optimizers
from zeroshard.engine.runtime._prefetch import PrefetchBudget
from zeroshard.engine.runtime._wire import WireKind
from zeroshard.engine.runtime.offload import steps_in_blocks
from zeroshard.engine.runtime.whole import steps_whole

GIB = 2**30


@dataclass(frozen=True)
class Estimate:
    """Per-rank memory (bytes) of one run and, given a compute figure, its step time."""

    world_size: int
    shard_size: int
    config: ZeroConfig
    micro_batch: int
    seq_len: int
    parameters: int
    states: Mapping[str, int]  # device bytes kept between steps, by kind
    grad_shards: int  # gradient shards (master dtype) on the device during a step
    gathered: int  # stage 3: bytes of units gathered at once (persistent + prefetched)
    activations_peak: int  # measured on meta, the gradient path included
    host: int  # offload: host bytes per rank (master, gradient, optimizer state, staging)
    pinned: int
    step: StepTime | None
    float8: int = 0  # stage 3: parameters gathered in fp8 (torchao's fp8 weights)
    # Whole-matrix optimizers (Muon): owners, Newton-Schulz FLOPs, bytes exchanged.
    whole_matrix: WholeMatrixCost | None = None
    snapshot: int = 0  # one rank's snapshot (zeroshard.engine.Snapshots)
    # Offload: of `host`, the busiest rank's optimizer state (as initialize's host check
    # counts it: whole-parameter optimizers' measured at the matrices each rank owns).
    host_state: int = 0

    @property
    def snapshot_host(self) -> tuple[int, int]:
        """Host bytes per rank that snapshots take, between them and while one is taken
        (`snapshot_host_bytes`)."""
        return snapshot_host_bytes(self.snapshot, self.world_size)

    @property
    def states_total(self) -> int:
        """Device bytes kept between steps."""
        return sum(self.states.values())

    @property
    def peak(self) -> int:
        """Projected peak device bytes of a step."""
        backward = self.states_total + self.activations_peak + self.gathered
        step = self.states_total + self.grad_shards + self._publish_inflight()
        return max(backward, step + self.step_scratch)

    @property
    def step_scratch(self) -> int:
        """Device bytes a whole-matrix optimizer's step allocates beside the states."""
        return 0 if self.whole_matrix is None else self.whole_matrix.scratch

    def _publish_inflight(self) -> int:
        if self.config.stage == 3:
            return 0
        return min(self.config.comm.allgather_bucket_bytes, self.states.get("parameters", 0))

    @property
    def tokens_per_s_per_gpu(self) -> float | None:
        """Projected tokens per second per GPU (None without a compute figure)."""
        if self.step is None:
            return None
        return self.micro_batch * self.seq_len / self.step.total_s

    def table(self) -> str:
        """A readable table of the estimate."""
        hybrid = (
            "" if self.shard_size == self.world_size else f", shard groups of {self.shard_size}"
        )
        cfg = self.config
        off = ""
        if cfg.offload.optimizer:
            off = ", offload optimizer" + (" + params" if cfg.offload.params else "")
        lines = [
            f"{self.parameters / 1e9:.2f}B parameters, stage {cfg.stage}, {self.world_size} GPUs"
            f"{hybrid}{off}, micro-batch {self.micro_batch} x {self.seq_len}, "
            f"{str(cfg.precision.compute_dtype).removeprefix('torch.')}",
            "",
            *state_rows(self.states, self.grad_shards),
        ]
        if cfg.stage == 3:
            fp8 = f" (fp8 for {self.float8 / 1e9:.2f}B parameters)" if self.float8 else ""
            lines.append(f"| gathered units in flight{fp8} | {self.gathered / GIB:.2f} |")
        if self.step_scratch:
            lines.append(
                f"| whole-matrix step scratch (in a step) | {self.step_scratch / GIB:.2f} |"
            )
        lines += [
            f"| activations + gradient path (on meta) | {self.activations_peak / GIB:.2f} |",
            f"| = projected peak | {self.peak / GIB:.2f} |",
        ]
        if self.host:
            lines.append(
                f"| host (offload), of it pinned | {self.host / GIB:.2f}, {self.pinned / GIB:.2f} |"
            )
        w = self.whole_matrix
        if w is not None:
            mib = 2**20
            lines += [
                "",
                f"whole-matrix step: Newton-Schulz {w.max_flops / 1e9:.1f} GFLOP on the busiest "
                f"of {w.owners.size} ranks (max/mean {w.balance:.3f}), its exchange with the "
                f"owners {w.sent_bytes / mib:.0f} MiB sent and {w.received_bytes / mib:.0f} MiB "
                f"received per rank, beside {w.other_bytes / mib:.0f} MiB the step's other "
                "collectives send",
            ]
        if self.step is not None:
            lines += ["", self.step.report_line(self.micro_batch * self.seq_len)]
        return "\n".join(lines)


def _gathered(plan: GroupPlan, cfg: ZeroConfig) -> int:
    """Stage 3: persistent units plus the unit in use and those prefetched behind it."""
    if cfg.stage != 3:
        return 0
    persistent = sum(u.gathered_bytes for u in plan.units if u.persistent)
    moving = sorted((u.gathered_bytes for u in plan.units if not u.persistent), reverse=True)
    if not moving:
        return persistent
    # The largest unit in use, and the next largest prefetched behind it by the engine's
    # own budget.
    budget = PrefetchBudget.of(cfg.stage3)
    ahead = moving[1 : 1 + budget.depth]
    taken = budget.take(ahead, persistent + moving[0])
    return persistent + moving[0] + sum(ahead[:taken])


def _check_own_groups(
    model: nn.Module,
    own: Mapping[str, int],
    world_size: int,
    timed: bool,
    optimizers: Sequence[torch.optim.Optimizer],
) -> None:
    """ValueError naming what `estimate` cannot price of `process_groups` (`own`)."""
    if not own:
        return
    for path, size in own.items():
        model.get_submodule(path)  # AttributeError naming a path the model lacks
        if not 1 <= size <= world_size:
            raise ValueError(
                f"process_groups[{path!r}] is {size} ranks: a group of its own holds 1 to "
                f"world_size ({world_size}) ranks"
            )
    if timed:
        raise ValueError(
            "process_groups prices memory only: the step time of groups of their own "
            "(experts) is not modelled; give no compute"
        )
    if any(steps_whole(o) for o in optimizers):
        raise ValueError(
            "process_groups with a whole-matrix optimizer: its step over groups of their own "
            "(experts) is not modelled"
        )


def check_inputs(
    cfg: ZeroConfig, world_size: int, micro_batch: int, seq_len: int, step_in_backward: bool
) -> None:
    """The errors `estimate` raises before it runs anything."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if micro_batch < 1 or seq_len < 1:
        raise ValueError(f"micro_batch and seq_len must be >= 1, got {micro_batch}, {seq_len}")
    if step_in_backward:
        check_step_in_backward(cfg)
    shard = cfg.shard_group_size or world_size
    if world_size % shard:
        raise ValueError(
            f"shard_group_size {shard} does not divide the world of {world_size} ranks"
        )


def trace_micro_batch(
    model: nn.Module, cfg: ZeroConfig, micro_batch: int, seq_len: int, loss_fn: LossFn
) -> OperatorTrace:
    """The operators' bytes of one micro-batch of `model` in `cfg`'s compute dtype: what
    `estimate_on_trace` needs, the same for every config of that dtype."""
    # The engine computes in the compute dtype: the activations are measured on such a copy,
    # whose torchao fp8 weights are plain, as the engine's (runtime/_float8.py).
    runnable = copy.deepcopy(model)
    unwrap_float8_weights(runnable)
    runnable = runnable.to(cfg.precision.compute_dtype)
    return trace_operators(runnable, micro_batch, seq_len, loss_fn)


def estimate(
    model: nn.Module,
    config: ZeroConfig | Mapping[str, Any] | None,
    world_size: int,
    micro_batch: int,
    seq_len: int,
    *,
    compute: Compute | None = None,
    cluster: Cluster | None = None,
    optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer] | None = None,
    loss_fn: LossFn = default_loss,
    optimizer_bytes_per_element: int = 8,
    step_in_backward: bool = False,
    process_groups: Mapping[str, int] | None = None,
) -> Estimate:
    """Per-rank memory and (given `compute`) step time of `model` trained under `config`.

    `model` must be on the meta device (nothing is allocated). `optimizer` (one, or
    several as `initialize` takes them) decides the param groups and prices a
    whole-matrix optimizer's step (`Estimate.whole_matrix`); `optimizer_bytes_per_element`
    is the optimizer state per fp32 master element (AdamW: m and v, 8; torch.optim.Muon
    keeps 4, its momentum); `loss_fn(model, idx)` runs one micro-batch of token ids
    (default: next-token cross entropy); `step_in_backward`: each backward runs under the
    optimizer's `step_in_backward()`; `process_groups` maps module paths on process
    groups of their own (experts: `initialize`'s `process_groups`) to the size of such a
    group, over which their flat groups are sharded (memory only: their step time and a
    whole-matrix optimizer's step over them are not modelled).
    """
    cfg = as_config(config)
    check_inputs(cfg, world_size, micro_batch, seq_len, step_in_backward)
    return estimate_on_trace(
        trace_micro_batch(model, cfg, micro_batch, seq_len, loss_fn),
        model,
        cfg,
        world_size,
        compute=compute,
        cluster=cluster,
        optimizer=optimizer,
        optimizer_bytes_per_element=optimizer_bytes_per_element,
        step_in_backward=step_in_backward,
        process_groups=process_groups,
    )


def estimate_on_trace(
    trace: OperatorTrace,
    model: nn.Module,
    cfg: ZeroConfig,
    world_size: int,
    *,
    compute: Compute | None = None,
    cluster: Cluster | None = None,
    optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer] | None = None,
    optimizer_bytes_per_element: int = 8,
    step_in_backward: bool = False,
    process_groups: Mapping[str, int] | None = None,
) -> Estimate:
    """`estimate` with the micro-batch already traced (`trace_micro_batch`), so that
    several configs of one compute dtype cost one forward and backward on meta."""
    if trace.dtype != cfg.precision.compute_dtype:
        raise ValueError(f"the trace ran in {trace.dtype}, the config computes in another dtype")
    micro_batch, seq_len = trace.micro_batch, trace.seq_len
    check_inputs(cfg, world_size, micro_batch, seq_len, step_in_backward)
    shard = cfg.shard_group_size or world_size
    optimizers = [] if optimizer is None else as_optimizers(optimizer, model)
    groups_of = None
    if optimizers:
        groups_of = {
            id(p): k
            for k, pg in enumerate(pg for o in optimizers for pg in o.param_groups)
            for p in pg["params"]
        }
    # Without the optimizer, the host counts one group's fp32 upcast (the larger case).
    blocked = bool(optimizers) and all(steps_in_blocks(o) for o in optimizers)
    own = dict(process_groups or {})
    _check_own_groups(model, own, world_size, compute is not None, optimizers)
    plan = plan_groups(model, cfg, shard, groups_of, blocked, own_sizes=own)
    whole = whole_matrix_cost(plan.groups, cfg, optimizers)
    # The engine's own rule where the optimizers are known (`state_floats`), else the
    # figure given for every param group.
    # An optimizer on whole parameters keeps its state at the owners (`whole`), none on
    # the shards.
    at_owners = owner_state_groups(optimizers)
    state_per_element = {
        k: 0 if k in at_owners else 4 * n
        for k, n in state_floats_by_param_group(optimizers).items()
    }
    owner_state = 0 if whole is None else whole.owner_state_bytes
    owner_host = 0 if whole is None else whole.owner_host_state_bytes
    host, pinned = host_bytes(
        plan,
        cfg,
        state_per_element or optimizer_bytes_per_element,
        optimizers,
        step_in_backward=step_in_backward,
    )
    # Pinned on a GPU's host, as offload's own buffers ([Note: whole parameters
    # offloaded]).
    host = host + owner_host
    pinned += owner_host if cfg.offload.pin_memory else 0
    per_element = state_per_element or optimizer_bytes_per_element
    host_state = 0 if plan.offload is None else host_state_bytes(plan, cfg, per_element)
    states = state_bytes(plan, cfg, per_element)
    states["optimizer"] += owner_state
    step = None
    if compute is not None:
        step = project_step(
            plan,
            cfg,
            world_size,
            cluster or Cluster(),
            compute,
            step_in_backward=step_in_backward,
            whole=whole,
        )
    return Estimate(
        world_size=world_size,
        shard_size=shard,
        config=cfg,
        micro_batch=micro_batch,
        seq_len=seq_len,
        parameters=sum(p.numel() for p in model.parameters()),
        states=states,
        grad_shards=grad_shard_bytes(plan, cfg),
        gathered=_gathered(plan, cfg),
        activations_peak=GradPath(plan, cfg).peak(trace),
        host=host,
        pinned=pinned,
        step=step,
        float8=sum(g.layout.numel for g in plan.groups if g.wire is WireKind.FLOAT8),
        whole_matrix=whole,
        snapshot=snapshot_bytes(plan, cfg, state_per_element) + owner_state + owner_host,
        host_state=host_state + owner_host,
    )
