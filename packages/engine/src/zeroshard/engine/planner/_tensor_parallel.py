"""`zeroshard-plan --tp N`: zeroshard over the data-parallel ranks of a model split over
N tensor-parallel ranks (the split and its collectives: `_tp_split.py`), and the report.

Model states are the flat groups `initialize()` builds from each rank's pieces
(`plan_groups` on a meta model whose split parameters have their local shapes), sharded
over world / N ranks, or under hybrid sharding (a 3-D mesh, `dp_replicate` x `dp_shard`
x `tp`) over the `dp_shard` ranks of one replica. torch's Muon prices its momentum per
rank and its step's scratch, the matrices joined whole over tp included ([Note: the
whole-matrix step's scratch] in _whole.py).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from zeroshard.engine.config._config import ZeroConfig
from zeroshard.engine.planner._cluster import Cluster
from zeroshard.engine.planner._groups import (
    grad_shard_bytes,
    host_bytes,
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
from zeroshard.engine.planner._tp_split import (
    Collective,
    collectives,
    localize,
    split_styles,
    tensor_parallel_time,
)
from zeroshard.engine.planner._whole import (
    WholeMatrixCost,
    owner_state_groups,
    whole_matrix_cost,
)
from zeroshard.engine.runtime._optimizer_state import state_floats_by_param_group
from zeroshard.engine.runtime._tensor_parallel import SPLIT_LABEL
from zeroshard.engine.runtime.offload import steps_in_blocks
from zeroshard.partition import DEFAULT_GROUP_LABEL

GIB = 2**30


@dataclass(frozen=True)
class TensorParallelPlan:
    """A run under tensor parallelism: `tp` x dp (x `replicas`) = `world_size` GPUs."""

    tp: int
    world_size: int
    sequence_parallel: bool
    config: ZeroConfig
    parameters: int
    split: int  # parameters cut over tp (whole count)
    per_rank: int  # parameters one rank holds (its pieces, and the whole of the rest)
    states: Mapping[str, int]  # model states per rank, zeroshard over dp
    grad_shards: int
    collectives: tuple[Collective, ...]
    cluster: Cluster
    host: int = 0  # offload: host bytes per rank (as `Estimate.host`)
    pinned: int = 0  # of them pinned
    replicas: int = 1  # hybrid sharding: the mesh's dp_replicate
    whole_matrix: WholeMatrixCost | None = None  # a whole-matrix optimizer: its step
    snapshot: int = 0  # one rank's snapshot (zeroshard.engine.Snapshots)
    tokens: int = 0  # of a micro-batch, which every rank of a tp group computes together
    step: StepTime | None = None  # given a compute figure
    tp_step_s: float = 0.0  # of it the tensor-parallel collectives (recomputed ones too)

    @property
    def tokens_per_s_per_gpu(self) -> float | None:
        """Projected tokens per second per GPU (a tp group's GPUs share their tokens;
        None without a compute figure)."""
        if self.step is None:
            return None
        return self.tokens / self.tp / self.step.total_s

    @property
    def dp(self) -> int:
        """Ranks each flat group is sharded over (the mesh's dp, or dp_shard)."""
        return self.world_size // self.tp // self.replicas

    @property
    def snapshot_host(self) -> tuple[int, int]:
        """Host bytes per rank that snapshots take, between them and while one is taken
        (`snapshot_host_bytes`)."""
        return snapshot_host_bytes(self.snapshot, self.world_size)

    @property
    def tp_seconds(self) -> float:
        """Tensor-parallel collective time of one micro-batch."""
        return sum(c.seconds(self.cluster, self.tp) for c in self.collectives)

    def table(self) -> str:
        """A readable table of the plan."""
        sp = ", sequence parallel" if self.sequence_parallel else ""
        offload = self.config.offload
        off = ""
        if offload.optimizer:
            off = ", offload optimizer" + (" + params" if offload.params else "")
        dp = f"dp {self.dp}"
        if self.replicas > 1:
            dp = f"dp_shard {self.dp} x dp_replicate {self.replicas}"
        lines = [
            f"{self.parameters / 1e9:.2f}B parameters, tp {self.tp}{sp} x {dp}, stage "
            f"{self.config.stage}{off}: {self.split / 1e9:.2f}B split over tp, each rank holds "
            f"{self.per_rank / 1e9:.2f}B, sharded over dp {self.dp}",
            "",
            *state_rows(self.states, self.grad_shards),
        ]
        if self.whole_matrix is not None:
            lines.append(
                "| whole-matrix step scratch (in a step; matrices joined over tp) | "
                f"{self.whole_matrix.scratch / GIB:.2f} |"
            )
        if self.host:
            lines.append(
                f"| host (offload), of it pinned | {self.host / GIB:.2f}, {self.pinned / GIB:.2f} |"
            )
        lines += [
            "",
            "| tensor-parallel collectives of a micro-batch | per micro-batch | MiB each | ms |",
            "|---|---|---|---|",
        ]
        for c in self.collectives:
            lines.append(
                f"| {c.layer}: {c.phase} {c.op} | {c.count} | {c.nbytes / 2**20:.1f} | "
                f"{c.seconds(self.cluster, self.tp) * 1e3:.2f} |"
            )
        lines.append(
            f"| = on the critical path | {sum(c.count for c in self.collectives)} | | "
            f"{self.tp_seconds * 1e3:.2f} |"
        )
        lines.append(
            "(activations are not projected with --tp: they are the split model's, which "
            "the meta trace does not run)"
        )
        if self.step is not None:
            line = self.step.report_line(
                self.tokens / self.tp,
                compute=f": 1/{self.tp} of one GPU's",
                communication=f", of it tensor-parallel {self.tp_step_s * 1e3:.0f}",
            )
            lines += ["", line]
        return "\n".join(lines)


def plan_tensor_parallel(
    model: nn.Module,
    cfg: ZeroConfig,
    *,
    world_size: int,
    tp: int,
    micro_batch: int,
    seq_len: int,
    sequence_parallel: bool,
    cluster: Cluster,
    optimizer_bytes_per_element: int = 8,
    styles: Mapping[str, str] | None = None,
    param_group_of: Mapping[int, int] | None = None,
    optimizers: Sequence[torch.optim.Optimizer] | None = None,
    shard_group_size: int | None = None,
    compute: Compute | None = None,
    step_in_backward: bool = False,
) -> TensorParallelPlan:
    """Split `model` (meta, changed in place) over `tp` and plan zeroshard over the rest.

    `styles` (module path -> `COLWISE`, `ROWWISE`, `EMBEDDING` or `GATHERED`) defaults
    to the model's own `tp_plan` or the presets' names; `param_group_of` maps id(param)
    of `model` as given to its optimizer param group (None: all in one). `optimizers`
    (built on `model` as given) decide the param groups and their state per element by
    the runtime's own rule (`state_floats`), in place of those two, and price torch's
    Muon's step. `shard_group_size`: GPUs of one replica of a 3-D mesh (`dp_shard` x
    `tp`; None: one replica of all). `compute` (a one-GPU step of the whole model, on the
    same micro-batch) projects the step ([Note: the step under tensor parallelism] in
    _step_time.py), its backward under `step_in_backward()` if so.
    """
    if tp < 1 or world_size % tp:
        raise ValueError(f"--tp {tp} does not divide --world {world_size}")
    replica = world_size if shard_group_size is None else shard_group_size
    if replica < 1 or world_size % replica or replica % tp:
        raise ValueError(
            f"--shard-group-size {replica} must divide --world {world_size} and be a "
            f"multiple of --tp {tp} (a replica of the 3-D mesh is dp_shard x tp GPUs)"
        )
    if step_in_backward:
        check_step_in_backward(cfg)
    if sequence_parallel and seq_len % tp:
        raise ValueError(f"sequence parallelism needs --seq divisible by --tp, got {seq_len}")
    styles = split_styles(model) if styles is None else styles
    if not styles:
        raise ValueError("no layer of this model matches a tensor-parallel plan")
    per_element: int | Mapping[int, int] = optimizer_bytes_per_element
    blocked = False
    if optimizers is not None:
        pgs = [pg for o in optimizers for pg in o.param_groups]
        param_group_of = {id(p): k for k, pg in enumerate(pgs) for p in pg["params"]}
        # An optimizer on whole parameters keeps its state at the owners (`whole`), none on
        # the shards.
        at_owners = owner_state_groups(optimizers)
        per_element = {
            k: 0 if k in at_owners else 4 * n
            for k, n in state_floats_by_param_group(list(optimizers)).items()
        }
        blocked = len(optimizers) == 1 and steps_in_blocks(optimizers[0])
    parameters = sum(p.numel() for p in model.parameters())
    tokens = micro_batch * seq_len
    itemsize = cfg.precision.compute_dtype.itemsize
    ops = collectives(model, styles, tokens, itemsize, sequence_parallel)
    before = {id(p): p for p in model.parameters()}
    whole_shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    pieces = localize(model, styles, tp)
    split = sum(before[i].numel() for i in pieces)
    per_rank = sum(p.numel() for p in model.parameters())
    cut = {id(p) for p in pieces.values()}
    groups_of = None
    if param_group_of is not None:
        groups_of = {id(pieces.get(i, p)): param_group_of[i] for i, p in before.items()}
    # Flat groups as initialize() forms them: the split parameters apart; a host group
    # holds a rank's pieces as a device group does.
    plan = plan_groups(
        model,
        cfg,
        replica // tp,
        groups_of,
        blocked,
        process_group_of=lambda _, p: SPLIT_LABEL if id(p) in cut else DEFAULT_GROUP_LABEL,
    )
    host, pinned = host_bytes(
        plan, cfg, per_element, optimizers or (), step_in_backward=step_in_backward
    )
    whole = (
        None
        if optimizers is None
        else whole_matrix_cost(plan.groups, cfg, optimizers, tp, whole_shapes)
    )
    states = state_bytes(plan, cfg, per_element)
    snapshot = snapshot_bytes(plan, cfg, per_element)
    if whole is not None:
        # A declared optimizer's state, the whole matrices' at their owners.
        states["optimizer"] += whole.owner_state_bytes
        host += whole.owner_host_state_bytes
        if cfg.offload.pin_memory:  # on a GPU's host, as offload's buffers
            pinned += whole.owner_host_state_bytes
        snapshot += whole.owner_state_bytes + whole.owner_host_state_bytes
    step, tp_step = None, 0.0
    if compute is not None:
        timed = tensor_parallel_time(ops, cluster, tp)
        tp_step = timed.backward_s + timed.forward_s * (2 if compute.recompute else 1)
        step = project_step(
            plan,
            cfg,
            world_size,
            cluster,
            compute,
            step_in_backward=step_in_backward,
            whole=whole,
            tp=timed,
        )
    return TensorParallelPlan(
        tp,
        world_size,
        sequence_parallel,
        cfg,
        parameters,
        split,
        per_rank,
        states,
        grad_shard_bytes(plan, cfg),
        ops,
        cluster,
        host,
        pinned,
        world_size // replica,
        whole,
        snapshot,
        tokens,
        step,
        tp_step,
    )
