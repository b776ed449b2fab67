"""Step time: measured compute plus the communication the engine cannot hide behind it.

[Note: the overlap model]
Compute is one measured figure: a single-GPU step with no communication (or FLOPs over a
measured FLOP/s), split into forward and backward as 1 : 2 (1 : 3 under activation
checkpointing, whose backward recomputes the forward). Stage 3 prefetches the next unit
while one computes (when the engine's `PrefetchBudget` admits the largest unit behind
one as large), so forward takes max(compute, gathers) plus the first gather, which
nothing hides; the backward likewise hides its gathers, reduce-scatters and (hybrid)
replica all-reduces behind its compute, all on one communication stream, except the last
group's reduction.
Stage 2 reduces in backward the same way; stage 1 reduces after backward. Stages 1/2
all-gather the updated parameters after the step, exposed.

[Note: the offload model]
An offloaded optimizer steps on the CPU, whose step is bound by host memory: it is
priced at the bytes it moves there, at the rate a measured torch fused AdamW achieved
(28 bytes a parameter: fp32 master, exp_avg and exp_avg_sq read and written, an fp32
gradient read). The offloaded step moves the master and moments (24 bytes), the gradient
that the bus writes and the step reads (twice the reduce dtype), and what goes up: the
fp32 master the bus reads (4), or with `offload.params` the compute-dtype shard the step
writes (its lines read first) and stage 3's forward and backward gathers each read (4 x
its itemsize). The bus's copies count because they land in and leave from the same
memory: at bf16, 32 bytes against fused AdamW's 28, and the measured
`delay_param_update` step is near that ratio to fused AdamW alone (docs/benchmarks.md,
offload-goal1-again, the record of six runs). The serial step adds that CPU time to the GPU's; under
`step_in_backward()` the CPU steps groups as backward hands them over, so backward and
the CPU overlap and the next forward waits; with `offload.delay_param_update` the CPU
step runs beside the next forward and backward, so the step is the longer of the two.

[Note: the step under tensor parallelism]
Under tp over N consecutive GPUs each rank computes 1/N of every split layer: the
measured one-GPU compute (of the whole model, on the same micro-batch) is divided by N,
Megatron's split of every matmul (attention by heads); what it leaves whole on each rank
(norms, the loss over the gathered logits, elementwise work) is taken as negligible, so
the compute is an underestimate where that work is not. The tensor-parallel collectives
of the micro-batch ([Note: tensor-parallel collectives] in _tp_split.py) are on
the critical path, torch's eager TP waiting for each: the forward's add to the forward,
the backward's to the backward, and under activation checkpointing the forward's again
in the backward (the recomputed forward issues them again). zeroshard's own collectives
are those of the flat groups over the data-parallel ranks, N apart (`stride`), priced by
the overlap model above on the link those span; a whole-matrix optimizer's exchange too.
Under tp a whole-matrix optimizer's all-gathers over tp and its Newton-Schulz on the
joined matrices (duplicated on every tp rank) are not added (the FLOPs priced are each
owner's pieces').

[Note: the whole-matrix step]
A whole-matrix optimizer (torch.optim.Muon) steps after backward and before the publish:
its exchange with each matrix's owners (`WholeMatrixCost`: the busiest rank's bytes over
the shard group's link, and the latency of each all-to-all) is exposed, and so is the
busiest rank's Newton-Schulz work when compute is given in FLOPs (its FLOPs over the
achieved rate). A measured one-GPU `step_s` already holds the orthogonalization of
every matrix, so it is not added again (an overestimate of the busiest rank's share).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from zeroshard.engine.config._config import ZeroConfig
from zeroshard.engine.planner._cluster import Cluster
from zeroshard.engine.planner._groups import GroupPlan, reduce_dtype_bytes
from zeroshard.engine.planner._whole import WholeMatrixCost
from zeroshard.engine.runtime._home import HomeKind
from zeroshard.engine.runtime._prefetch import PrefetchBudget
from zeroshard.engine.runtime._stepper import step_in_backward_refusal


@dataclass(frozen=True)
class Compute:
    """What one step costs without communication, for this micro-batch.

    Attributes:
        step_s: measured seconds of one single-GPU step (forward, backward, optimizer)
            on the same micro-batch; or None to use `flops_per_step / flops_per_s`.
        flops_per_step / flops_per_s: model FLOPs of a step and a measured achieved rate.
        recompute: activation checkpointing (the backward recomputes the forward).
        cpu_adam_params_per_s: measured rate of torch's fused CPU AdamW, parameters a second
            on the host's cores (offload); None: offload unpriced.
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
class TensorParallelTime:
    """Tensor parallelism in a step ([Note: the step under tensor parallelism]): the GPUs
    of a tp group, and the seconds and count of its collectives in one micro-batch's
    forward and backward."""

    size: int
    forward_s: float
    backward_s: float
    forward_count: int
    backward_count: int


@dataclass(frozen=True)
class StepTime:
    """A projected step, in seconds, and what limits it."""

    total_s: float
    compute_s: float
    comm_s: float  # all communication issued in the step
    exposed_s: float  # the part not hidden behind compute (and the CPU optimizer)
    bound: str  # 'compute', 'bandwidth', 'latency' or 'cpu optimizer'
    cpu_s: float = 0.0  # the offloaded optimizer's CPU step ([Note: the offload model])

    def report_line(
        self, tokens_per_gpu: float, *, compute: str = "", communication: str = ""
    ) -> str:
        """The planner report's "step ... ms" line, for `tokens_per_gpu` a step; `compute`
        and `communication` are clauses said after those figures (tensor parallelism's
        share and collectives)."""
        total, comp, comm, exposed, cpu_s = (
            f"{t * 1e3:.0f}"
            for t in (self.total_s, self.compute_s, self.comm_s, self.exposed_s, self.cpu_s)
        )
        cpu = f", CPU optimizer {cpu_s}" if self.cpu_s else ""
        # A clause brings commas of its own: the figures are then set apart by semicolons.
        sep = "; " if compute or communication else ", "
        return (
            f"step {total} ms (compute {comp}{compute}{sep}communication {comm}{communication}"
            f"{cpu}{sep}exposed {exposed}; "
            f"{self.bound}-bound), {tokens_per_gpu / self.total_s:,.0f} tokens/s/GPU"
        )


# Bytes a parameter that torch's fused AdamW moves through memory ([Note: the offload model]).
_FUSED_ADAMW_BYTES = 28


def host_bytes_per_param(cfg: ZeroConfig) -> int:
    """Bytes of host memory traffic per offloaded parameter and step, the bus's copies
    included ([Note: the offload model])."""
    gradient = 2 * reduce_dtype_bytes(cfg)
    upload = 4 * cfg.precision.compute_dtype.itemsize if cfg.offload.params else 4
    return 24 + gradient + upload


def check_step_in_backward(cfg: ZeroConfig) -> None:
    """Raise where the engine's `step_in_backward()` would refuse `cfg`."""
    why = step_in_backward_refusal(
        offloaded=cfg.offload.optimizer,
        stage=cfg.stage,
        # initialize scales the loss whenever it computes in fp16.
        loss_scaled=cfg.precision.compute_dtype == torch.float16,
        delayed=cfg.offload.delay_param_update,
    )
    if why:
        raise ValueError(f"step_in_backward: {why}")


def project_step(
    plan: GroupPlan,
    cfg: ZeroConfig,
    world: int,
    cluster: Cluster,
    compute: Compute,
    *,
    step_in_backward: bool = False,
    whole: WholeMatrixCost | None = None,
    tp: TensorParallelTime | None = None,
) -> StepTime:
    """The step time of one rank of `world` under `cfg` (backward under the optimizer's
    `step_in_backward()` if so, as `check_step_in_backward` allows); see [Note: the overlap
    model] and, for a whole-matrix optimizer (`whole`), [Note: the whole-matrix step].
    Under tensor parallelism (`tp`), `world` counts the GPUs of the run (`plan` shards
    over data-parallel ranks `tp.size` apart): [Note: the step under tensor parallelism]."""
    n = 1 if tp is None else tp.size
    # The shard group's ranks are n apart, the replicas shard * n.
    shard, replicas = plan.shard_size, world // n // plan.shard_size
    c = compute.seconds() / n
    fwd = c / (4 if compute.recompute else 3)
    bwd = c - fwd
    red = reduce_dtype_bytes(cfg)
    trainable = [g for g in plan.groups if g.trainable]
    # One reduce-scatter per group within the shard group, then (hybrid) an all-reduce of
    # its shard across the replicas.
    reduce = [
        cluster.reduce_scatter_s(g.layout.padded_numel * red, shard, stride=n)
        + cluster.all_reduce_s(g.layout.shard_numel * red, replicas, stride=shard * n)
        for g in trainable
    ]
    latency = len(trainable) * (
        cluster.latency_s(shard, stride=n) + 2 * cluster.latency_s(replicas, stride=shard * n)
    )
    tail = reduce[-1] if reduce else 0.0
    publish = 0.0
    if cfg.stage == 3:
        units = plan.units
        gather = [cluster.all_gather_s(u.gathered_bytes, shard, stride=n) for u in units]
        moving = [t for t, u in zip(gather, units, strict=True) if not u.persistent]
        once = sum(t for t, u in zip(gather, units, strict=True) if u.persistent)
        latency += (len(units) + len(moving)) * cluster.latency_s(shard, stride=n)
        largest = max((u.gathered_bytes for u in units if not u.persistent), default=0)
        persistent = sum(u.gathered_bytes for u in units if u.persistent)
        # Prefetched behind a unit as large, by the engine's own budget.
        if PrefetchBudget.of(cfg.stage3).admits(largest, persistent + largest):
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
                g.layout.padded_numel * cfg.precision.compute_dtype.itemsize, shard, stride=n
            )
            for g in trainable
        )
        latency += len(trainable) * cluster.latency_s(shard, stride=n)
        comm = sum(reduce) + publish
    if tp is not None:
        # On the critical path; a recomputed forward issues its collectives again.
        again = tp.forward_s if compute.recompute else 0.0
        f += tp.forward_s
        b += tp.backward_s + again
        comm += tp.forward_s + tp.backward_s + again
        count = tp.forward_count * (2 if compute.recompute else 1) + tp.backward_count
        latency += count * cluster.latency_s(n)
    cpu = 0.0
    if plan.offload is not None:
        if compute.cpu_adam_params_per_s is None:
            raise ValueError("an offloaded optimizer needs Compute.cpu_adam_params_per_s")
        moved = sum(
            g.layout.shard_numel for g in plan.groups if g.home is HomeKind.HOST and g.trainable
        )
        bandwidth = compute.cpu_adam_params_per_s * _FUSED_ADAMW_BYTES
        cpu = moved * host_bytes_per_param(cfg) / bandwidth
    # What the CPU step runs beside ([Note: the offload model]); the rest of it shows.
    hidden = f + b if cfg.offload.delay_param_update else (b if step_in_backward else 0.0)
    shown = max(cpu - hidden, 0.0)
    matrix = 0.0
    if whole is not None:
        exchange = whole.exchanges * cluster.latency_s(shard, stride=n) + max(
            whole.sent_bytes, whole.received_bytes
        ) / (cluster.link(shard, stride=n).gbps * 1e9)
        latency += whole.exchanges * cluster.latency_s(shard, stride=n)
        comm += exchange
        matrix = exchange
        if compute.step_s is None and compute.flops_per_s:
            matrix += whole.max_flops / compute.flops_per_s
    total = f + b + matrix + publish + shown
    exposed = total - c
    return StepTime(total, c, comm, exposed, _bound(total, exposed, shown, latency, comm), cpu)


def _bound(total: float, exposed: float, cpu: float, latency: float, comm: float) -> str:
    """What limits a step: the CPU optimizer (`cpu`: the part of its step that shows),
    nothing but compute, or the network."""
    if cpu > 0.05 * total and cpu >= exposed - cpu:
        return "cpu optimizer"
    if exposed - cpu < 0.05 * total:
        return "compute"
    return "latency" if latency > 0.5 * comm else "bandwidth"
