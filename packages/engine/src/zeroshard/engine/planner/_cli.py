"""`zeroshard-plan`: memory, step time and a recommended config for a run, before buying it.
The command's arguments are `_arguments.py`'s; this builds the plan and prints it."""

from __future__ import annotations

import sys
from collections.abc import Sequence

import torch

from zeroshard.engine.config._config import ZeroConfig
from zeroshard.engine.planner import _arguments as arguments
from zeroshard.engine.planner._activations import OperatorTrace, default_loss
from zeroshard.engine.planner._cluster import Cluster, Link
from zeroshard.engine.planner._composition import check_composition, check_step_priced
from zeroshard.engine.planner._estimate import (
    GIB,
    Estimate,
    check_inputs,
    estimate_on_trace,
    trace_micro_batch,
)
from zeroshard.engine.planner._groups import journal_entry_bytes, plan_groups, snapshot_host_bytes
from zeroshard.engine.planner._presets import PRESETS, build, convert_float8
from zeroshard.engine.planner._recommend import MEMORY_ONLY_RULE, candidate_configs, recommend
from zeroshard.engine.planner._step_time import Compute
from zeroshard.engine.planner._tensor_parallel import TensorParallelPlan, plan_tensor_parallel
from zeroshard.engine.planner._whole import muon_recipe


def _snapshot_rows(
    e: Estimate | TensorParallelPlan, host_gib: float, ranks: int, full_every: int, entry: int
) -> str:
    """What snapshots (with a journal of `entry`-byte entries when `full_every` > 1) take
    of a node's host memory; ValueError when they do not fit."""
    steady, peak = snapshot_host_bytes(e.snapshot, e.world_size, entry, full_every)
    node = (peak + e.host) * ranks
    offload = f" and offload's {e.host * ranks / GIB:.2f}" if e.host else ""
    journal = ""
    if full_every > 1:
        replicas = " and as many replicas" if e.world_size > 1 else ""
        journal = f"; a journal entry {entry / GIB:.2f} GiB, {full_every} held{replicas}"
    text = (
        f"\nsnapshots in host memory per rank: {e.snapshot / GIB:.2f} GiB a copy{journal}; "
        f"{steady / GIB:.2f} GiB between snapshots (two slots, pinned, and a replica), "
        f"{peak / GIB:.2f} GiB while one is taken; a node of {ranks} ranks needs "
        f"{node / GIB:.2f} GiB (snapshots{offload}) of its {host_gib:g} GiB"
    )
    if node > host_gib * GIB:
        less = (
            "A smaller --full-every holds fewer journal entries; else"
            if full_every > 1
            else "Taking them less often does not help (two steps are held while one is taken):"
        )
        raise ValueError(
            f"snapshots do not fit in host memory: {text.strip()}. {less} more nodes, less "
            "offload, or checkpoints on disk only"
        )
    return text


def main(argv: Sequence[str] | None = None) -> int:
    """Print the memory table, the projected step and (with a limit) a recommendation."""
    a = arguments.parser().parse_args(argv)
    try:
        arguments.check(a)
        cfg = arguments.config(a)
        model = build(
            a.model, activation_checkpointing=a.activation_checkpointing, n_layer=a.layers
        )
        if a.fp8 != "none":
            convert_float8(model, a.fp8, a.fp8_all_gather)
        if a.seq is None and a.model not in PRESETS:
            raise ValueError("--seq is needed with a config.json (presets have their own)")
        seq = a.seq or PRESETS[a.model].seq_len
        compute = arguments.compute(a, a.micro_batch * seq)
        if compute is None:
            print(f"({arguments.NOT_PRICED}: memory only)")
        priced = compute is not None
        if a.offload != "none" and priced and a.cpu_adam_params_per_s is None:
            raise ValueError("offload step time needs --cpu-adam-params-per-s (a measured rate)")
        cluster = Cluster(
            a.gpus_per_node,
            internode=Link(a.internode_gbps, a.internode_latency_us),
        )
        optimizers = muon_recipe(model) if a.optimizer == "muon" else None
        check_composition(cfg, optimizers or [], step_in_backward=a.offload_overlap == "backward")
        if priced:
            check_step_priced(cfg, optimizers or [])
        if a.tp > 1:
            # --shard-group-size is a replica of the 3-D mesh, which the engine takes as
            # the mesh's dp_replicate dim, not as shard_group_size.
            split = plan_tensor_parallel(
                model,
                cfg.replace(shard_group_size=None),
                world_size=a.world,
                tp=a.tp,
                micro_batch=a.micro_batch,
                seq_len=seq,
                sequence_parallel=a.sequence_parallel,
                cluster=cluster,
                optimizers=optimizers,
                shard_group_size=a.shard_group_size,
                compute=compute,
                step_in_backward=a.offload_overlap == "backward" and cfg.offload.optimizer,
            )
            print(split.table())
            if a.snapshots is not None:
                ranks = min(a.gpus_per_node, a.world)
                # The device's gradient shards (an offloaded group's are not counted here).
                entry = split.grad_shards
                print(_snapshot_rows(split, a.snapshots, ranks, a.full_every, entry))
            return 0

        # One forward and backward on meta per compute dtype, whatever the configs compared.
        traces: dict[torch.dtype, OperatorTrace] = {}

        def run(c: ZeroConfig, comp: Compute | None = compute) -> Estimate:
            # Every offloaded config steps in backward; one the engine refuses it (stage 1,
            # fp16) raises, as the engine would.
            in_backward = a.offload_overlap == "backward" and c.offload.optimizer
            check_inputs(c, a.world, a.micro_batch, seq, in_backward)
            dtype = c.precision.compute_dtype
            if dtype not in traces:
                traces[dtype] = trace_micro_batch(model, c, a.micro_batch, seq, default_loss)
            return estimate_on_trace(
                traces[dtype],
                model,
                c,
                a.world,
                compute=comp,
                cluster=cluster,
                optimizer=optimizers,
                step_in_backward=in_backward,
            )

        first = run(cfg)
        print(first.table())
        if a.snapshots is not None:
            ranks = min(a.gpus_per_node, a.world)
            entry = journal_entry_bytes(plan_groups(model, cfg, first.shard_size), cfg)
            print(_snapshot_rows(first, a.snapshots, ranks, a.full_every, entry))
        if a.memory_limit_gib is not None:
            stage3 = cfg.replace(stage=3, offload_delay_param_update=False)
            units = plan_groups(model, stage3, 1).units
            largest = max((u.gathered_bytes for u in units if not u.persistent), default=0)
            configs = candidate_configs(cfg, a.world, a.gpus_per_node, largest)
            # An offloaded step is priced with a measured AdamW rate over fp32 masters.
            if compute is not None and (
                optimizers is not None
                or a.master_dtype == "bf16"
                or compute.cpu_adam_params_per_s is None
            ):
                configs = [c for c in configs if not c.offload.optimizer]
            rec = recommend(configs, run, int(a.memory_limit_gib * GIB))
            print(f"\nrecommendation within {a.memory_limit_gib:g} GiB per GPU:")
            for e in rec.candidates:
                mark = "*" if e is rec.best else " "
                c = e.config
                speed = f"{e.tokens_per_s_per_gpu:,.0f} tok/s/GPU" if e.step else "speed not priced"
                prefetch = (
                    f", prefetch {c.stage3.prefetch_bytes / GIB:.2f} GiB" if c.stage == 3 else ""
                )
                print(
                    f" {mark} stage {c.stage}, shard {e.shard_size}, offload "
                    f"{'on' if c.offload.optimizer else 'off'}{prefetch}: "
                    f"peak {e.peak / GIB:.1f} GiB, {speed}"
                )
            if rec.best is None:
                print("   nothing fits: more GPUs, a smaller micro-batch, or offload params")
            elif compute is None:
                print(f"   * speed not priced ({arguments.NOT_PRICED}): {MEMORY_ONLY_RULE}")
    except ValueError as e:
        print(f"zeroshard-plan: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
