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

from zeroshard.engine.config._config import ZeroConfig
from zeroshard.engine.planner._cluster import Cluster
from zeroshard.engine.planner._groups import GroupPlan, reduce_dtype_bytes


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
    trainable = [g for g in plan.groups if g.trainable]
    # One reduce-scatter per group within the shard group, then (hybrid) an all-reduce of
    # its shard across the replicas, ranks `shard` apart.
    reduce = [
        cluster.reduce_scatter_s(g.layout.padded_numel * red, shard)
        + cluster.all_reduce_s(g.layout.shard_numel * red, replicas, stride=shard)
        for g in trainable
    ]
    latency = len(trainable) * (
        cluster.latency_s(shard) + 2 * cluster.latency_s(replicas, stride=shard)
    )
    tail = reduce[-1] if reduce else 0.0
    publish = 0.0
    if cfg.stage == 3:
        units = plan.units
        gather = [cluster.all_gather_s(u.gathered_bytes, shard) for u in units]
        moving = [t for t, u in zip(gather, units, strict=True) if not u.persistent]
        once = sum(t for t, u in zip(gather, units, strict=True) if u.persistent)
        latency += (len(units) + len(moving)) * cluster.latency_s(shard)
        largest = max((u.gathered_bytes for u in units if not u.persistent), default=0)
        if cfg.stage3.prefetch_depth >= 1 and largest <= cfg.stage3.prefetch_bytes:
            head = once + (moving[0] if moving else 0.0)
            f = max(fwd, sum(moving)) + head
            b = max(bwd, sum(moving) + sum(reduce)) + tail
        else:
            # No prefetch: every gather waits in line before its unit computes.
            f = fwd + once + sum(moving)
            b = max(bwd + sum(moving), sum(moving) + sum(reduce)) + tail
        comm = once + 2 * sum(moving) + sum(reduce)
    else:
        f = fwd
        overlapped = cfg.stage == 2 and cfg.comm.overlap
        b = max(bwd, sum(reduce)) + tail if overlapped else bwd + sum(reduce)
        publish = sum(
            cluster.all_gather_s(
                g.layout.padded_numel * cfg.precision.compute_dtype.itemsize, shard
            )
            for g in trainable
        )
        latency += len(trainable) * cluster.latency_s(shard)
        comm = sum(reduce) + publish
    cpu = 0.0
    if plan.offload is not None:
        if compute.cpu_adam_params_per_s is None:
            raise ValueError("an offloaded optimizer needs Compute.cpu_adam_params_per_s")
        moved = sum(g.layout.shard_numel for g in plan.groups if g.offloaded and g.trainable)
        cpu = moved / compute.cpu_adam_params_per_s
    total = f + b + publish + cpu
    exposed = total - c
    return StepTime(total, c, comm, exposed, _bound(total, exposed, cpu, latency, comm))


def _bound(total: float, exposed: float, cpu: float, latency: float, comm: float) -> str:
    """What limits a step: the CPU optimizer, nothing but compute, or the network."""
    if cpu > 0.05 * total and cpu >= exposed - cpu:
        return "cpu optimizer"
    if exposed - cpu < 0.05 * total:
        return "compute"
    return "latency" if latency > 0.5 * comm else "bandwidth"
