"""Step time: measured compute plus the communication the engine cannot hide behind it.

[Note: the overlap model]
Compute is one measured figure: a single-GPU step with no communication (or FLOPs over a
measured FLOP/s), split into forward and backward as 1 : 2 (1 : 3 under activation
checkpointing, whose backward recomputes the forward). Stage 3 prefetches the next unit
while one computes (when `prefetch_depth` >= 1 and the unit fits in `prefetch_bytes`),
so forward takes max(compute, gathers) plus the first gather, which nothing hides; the
backward likewise hides its gathers, reduce-scatters and (hybrid) replica all-reduces
behind its compute, all on one communication stream, except the last group's reduction.
Stage 2 reduces in backward the same way; stage 1 reduces after backward. Stages 1/2
all-gather the updated parameters after the step, exposed. An offloaded optimizer steps
on the CPU, exposed, at a measured CPU AdamW rate.
"""

from __future__ import annotations

from dataclasses import dataclass

from zeroshard.engine._config import ZeroConfig
from zeroshard.engine._estimate_comm import Cluster
from zeroshard.engine._estimate_layout import GroupPlan, reduce_dtype_bytes


@dataclass(frozen=True)
class Compute:
    """What one step costs without communication, for this micro-batch.

    Attributes:
        step_s: measured seconds of one single-GPU step (forward, backward, optimizer)
            on the same micro-batch; or None to use `flops_per_step / flops_per_s`.
        flops_per_step / flops_per_s: model FLOPs of a step and a measured achieved rate.
        recompute: activation checkpointing (the backward recomputes the forward).
        cpu_adam_params_per_s: measured CPU AdamW rate (offload); None: offload unpriced.
    """

    step_s: float | None = None
    flops_per_step: float | None = None
    flops_per_s: float | None = None
    recompute: bool = False
    cpu_adam_params_per_s: float | None = None

    def seconds(self) -> float:
        """Seconds of compute per step."""
        if self.step_s is not None:
            return self.step_s
        if self.flops_per_step is None or not self.flops_per_s:
            raise ValueError("Compute needs step_s, or flops_per_step and flops_per_s")
        return self.flops_per_step / self.flops_per_s


@dataclass(frozen=True)
class StepTime:
    """A projected step, in seconds, and what limits it."""

    total_s: float
    compute_s: float
    comm_s: float  # all communication issued in the step
    exposed_s: float  # the part not hidden behind compute (and the CPU optimizer)
    bound: str  # 'compute', 'bandwidth', 'latency' or 'cpu optimizer'


def project_step(
    plan: GroupPlan, cfg: ZeroConfig, world: int, cluster: Cluster, compute: Compute
) -> StepTime:
    """The step time of one rank of `world` under `cfg`; see [Note: the overlap model]."""
    shard, replicas = plan.shard_size, world // plan.shard_size
    c = compute.seconds()
    fwd = c / (4 if compute.recompute else 3)
    bwd = c - fwd
    red = reduce_dtype_bytes(cfg)
    item = cfg.compute_dtype.itemsize
    trainable = [g for g in plan.groups if g.trainable]
    lat = 0.0

    def rs(g_bytes: int) -> float:
        return cluster.reduce_scatter_s(g_bytes, shard)

    def ar(g_bytes: int) -> float:
        return cluster.all_reduce_s(g_bytes, replicas, stride=shard)

    reduce = [rs(g.layout.padded_numel * red) + ar(g.layout.shard_numel * red) for g in trainable]
    latency_reduce = (
        len(trainable)
        * (
            (shard - 1) * cluster.link(shard).latency_us
            + 2 * (replicas - 1) * cluster.link(replicas, shard).latency_us * (replicas > 1)
        )
        * 1e-6
    )
    lat += latency_reduce
    if cfg.stage == 3:
        gathers = [cluster.all_gather_s(u.gathered_bytes, shard) for u in plan.units]
        moving = [t for t, u in zip(gathers, plan.units, strict=True) if not u.persistent]
        once = sum(t for t, u in zip(gathers, plan.units, strict=True) if u.persistent)
        lat += (2 * len(moving) + len(plan.units) - len(moving)) * (
            (shard - 1) * cluster.link(shard).latency_us * 1e-6
        )
        largest = max((u.gathered_bytes for u in plan.units if not u.persistent), default=0)
        prefetch = cfg.prefetch_depth >= 1 and largest <= cfg.prefetch_bytes
        head = once + (moving[0] if moving else 0.0)
        ag_fwd, ag_bwd = sum(moving), sum(moving)
        f = max(fwd, ag_fwd) + head if prefetch else fwd + ag_fwd + once
        tail = reduce[-1] if reduce else 0.0
        b = max(bwd, ag_bwd + sum(reduce)) + tail if prefetch else bwd + ag_bwd + tail
        if not prefetch:
            b = max(b, bwd + ag_bwd + sum(reduce))
        publish = 0.0
        comm = once + ag_fwd + ag_bwd + sum(reduce)
    else:
        f = fwd
        if cfg.stage == 2 and cfg.overlap:
            b = max(bwd, sum(reduce)) + (reduce[-1] if reduce else 0.0)
        else:
            b = bwd + sum(reduce)
        publish = sum(cluster.all_gather_s(g.layout.padded_numel * item, shard) for g in trainable)
        lat += len(trainable) * (shard - 1) * cluster.link(shard).latency_us * 1e-6
        comm = sum(reduce) + publish
    cpu = 0.0
    if plan.offload is not None:
        if compute.cpu_adam_params_per_s is None:
            raise ValueError("an offloaded optimizer needs Compute.cpu_adam_params_per_s")
        moved = sum(g.layout.shard_numel for g in plan.groups if g.offloaded and g.trainable)
        cpu = moved / compute.cpu_adam_params_per_s
    total = f + b + publish + cpu
    exposed = total - c
    if cpu > max(exposed - cpu, 0.0) and cpu > 0.05 * total:
        bound = "cpu optimizer"
    elif exposed - cpu < 0.05 * total:
        bound = "compute"
    elif lat > 0.5 * comm:
        bound = "latency"
    else:
        bound = "bandwidth"
    return StepTime(total, c, comm, exposed, bound)
