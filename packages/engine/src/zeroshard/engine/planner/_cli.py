"""`zeroshard-plan`: memory, step time and a recommended config for a run, before buying it."""

from __future__ import annotations

import argparse
import importlib.metadata
import re
import sys
from collections.abc import Sequence

import torch

from zeroshard.engine.config._config import ZeroConfig
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
from zeroshard.engine.planner._groups import plan_groups
from zeroshard.engine.planner._presets import PRESETS, build, convert_float8
from zeroshard.engine.planner._recommend import MEMORY_ONLY_RULE, candidate_configs, recommend
from zeroshard.engine.planner._step_time import Compute
from zeroshard.engine.planner._tensor_parallel import TensorParallelPlan, plan_tensor_parallel
from zeroshard.engine.planner._whole import muon_recipe


def _count(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 10**9 else f"{n / 1e6:.1f}M"


_SCALE = {"": 1.0, "k": 1e3, "m": 1e6, "b": 1e9, "g": 1e9, "t": 1e12}


def _amount(text: str) -> float:
    """A count as people write it: `5.3e9`, `5.3B`, `800M`, `12k` (case-insensitive)."""
    found = re.fullmatch(r"\s*([0-9.]+(?:e[+-]?[0-9]+)?)\s*([kmbgt]?)\s*", text.lower())
    if found is None:
        raise argparse.ArgumentTypeError(f"{text!r} is not a count (5.3e9, 5.3B, 800M, 12k)")
    return float(found.group(1)) * _SCALE[found.group(2)]


def _preset(name: str) -> str:
    """A preset named in any case (`7B`, `1.3B`, `Llama-70B`) as PRESETS spells it; any
    other name (a config.json path) as given."""
    return name.lower() if name.lower() in PRESETS else name


def _version() -> str:
    try:
        engine = importlib.metadata.version("zeroshard-engine")
    except importlib.metadata.PackageNotFoundError:  # run from a source tree on sys.path
        engine = "(not installed)"
    return f"zeroshard-plan {engine} (zeroshard-engine; torch {torch.__version__})"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="zeroshard-plan",
        description="Per-rank memory and projected step time of a zeroshard run.",
        epilog="Step times need a compute figure you measured: --step-ms, or "
        "--achieved-tflops with --flops-per-token (see docs/scaling.md).",
    )
    sizes = ", ".join(f"{name} ({_count(shape.parameters)})" for name, shape in PRESETS.items())
    p.add_argument("--version", action="version", version=_version())
    p.add_argument(
        "model",
        type=_preset,
        help=f"a preset (any case: 7B is 7b): {sizes}; or a Hugging Face config.json path",
    )
    p.add_argument("--world", type=int, required=True, help="GPUs in the run (required)")
    p.add_argument(
        "--layers",
        type=int,
        help="a preset with this many blocks instead of its own (7b with 34: the 7.06B GPT "
        "of docs/benchmarks.md's offload runs)",
    )
    p.add_argument(
        "--micro-batch", type=int, default=1, help="sequences per GPU per step (default 1)"
    )
    p.add_argument("--seq", type=int, help="sequence length (default: the preset's)")
    p.add_argument("--stage", type=int, default=3, choices=(1, 2, 3), help="ZeRO stage (default 3)")
    p.add_argument(
        "--shard-group-size",
        type=int,
        help="hybrid: shard within groups of this many GPUs, replicate across; with --tp "
        "the GPUs of one replica of the 3-D mesh, dp_shard x tp (default: all)",
    )
    p.add_argument(
        "--tp",
        type=int,
        default=1,
        help="tensor parallelism over this many consecutive GPUs (Megatron's split, or a "
        "Hugging Face model's tp_plan); zeroshard shards over the rest (default 1)",
    )
    p.add_argument(
        "--sequence-parallel",
        action="store_true",
        help="with --tp: activations between layers split along the sequence",
    )
    p.add_argument(
        "--offload",
        choices=("none", "optimizer", "params"),
        default="none",
        help="CPU offload: of optimizer state and masters, or also (stage 3) of the "
        "parameter shards (default none)",
    )
    p.add_argument(
        "--offload-overlap",
        choices=("none", "backward", "delayed"),
        default="none",
        help="the CPU step beside backward (step_in_backward) or beside the next forward "
        "and backward (delay_param_update); default none: after backward",
    )
    p.add_argument(
        "--dtype",
        default="bf16",
        choices=("bf16", "fp16", "fp32"),
        help="compute dtype (default bf16)",
    )
    p.add_argument(
        "--master-dtype",
        default="fp32",
        choices=("fp32", "bf16"),
        help="master weights and the optimizer state: bf16 halves them, with bf16 "
        "compute; an offloaded step's time is then not projected (default fp32)",
    )
    p.add_argument(
        "--fp8",
        choices=("none", "tensorwise", "rowwise"),
        default="none",
        help="train the linears (all but the head) with torchao's fp8 recipe (needs "
        "torchao; default none)",
    )
    p.add_argument(
        "--fp8-all-gather",
        action="store_true",
        help="with --fp8 tensorwise: stage 3 gathers those weights in fp8 "
        "(torchao's enable_fsdp_float8_all_gather)",
    )
    p.add_argument(
        "--optimizer",
        choices=("adamw", "muon"),
        default="adamw",
        help="AdamW on every parameter, or torch's Muon recipe: torch.optim.Muon on the "
        "hidden matrices, AdamW on the rest (prices Muon's state and step, offloaded or "
        "under --tp too: default adamw)",
    )
    p.add_argument(
        "--activation-checkpointing",
        action="store_true",
        help="recompute each block in backward (default off)",
    )
    p.add_argument(
        "--prefetch-bytes", type=int, help="stage 3 prefetch budget in bytes (default 1 GiB)"
    )
    p.add_argument(
        "--memory-limit-gib",
        type=float,
        help="also recommend the config predicted best within this many GiB per GPU",
    )
    p.add_argument(
        "--snapshots",
        type=float,
        metavar="HOST_GIB",
        help="price snapshots in host memory (zeroshard.engine.Snapshots) on nodes of this "
        "many GiB of host memory; refused when they do not fit",
    )
    p.add_argument("--gpus-per-node", type=int, default=8, help="GPUs per node (default 8)")
    p.add_argument(
        "--internode-gbps",
        type=float,
        default=50.0,
        help="GB/s per GPU between nodes (default 50, i.e. 400 Gb/s)",
    )
    p.add_argument(
        "--internode-latency-us",
        type=float,
        default=5.0,
        help="latency per hop between nodes, microseconds (default 5)",
    )
    p.add_argument(
        "--step-ms",
        type=float,
        help="measured step on one GPU (no communication), same micro-batch, ms",
    )
    p.add_argument(
        "--achieved-tflops",
        type=float,
        help="measured achieved TFLOP/s per GPU (needs --flops-per-token)",
    )
    p.add_argument(
        "--flops-per-token",
        type=float,
        help="training FLOPs per token (needs --achieved-tflops)",
    )
    p.add_argument(
        "--cpu-adam-params-per-s",
        type=_amount,
        help="measured rate of torch's fused AdamW on the host, parameters a second, "
        "5.3e9 or 5.3B (needed to price an offloaded step)",
    )
    return p


NOT_PRICED = "no --step-ms, nor --achieved-tflops with --flops-per-token"


def _config(a: argparse.Namespace) -> ZeroConfig:
    extra = {} if a.prefetch_bytes is None else {"prefetch_bytes": a.prefetch_bytes}
    return ZeroConfig.from_dict(
        {
            "stage": a.stage,
            "compute_dtype": a.dtype,
            "master_dtype": a.master_dtype,
            "shard_group_size": a.shard_group_size,
            "offload_optimizer": a.offload != "none",
            "offload_params": a.offload == "params",
            "offload_delay_param_update": a.offload_overlap == "delayed",
            **extra,
        }
    )


def _compute(a: argparse.Namespace, tokens: int) -> Compute | None:
    if a.step_ms is not None:
        step_s, flops, rate = a.step_ms / 1e3, None, None
    elif a.achieved_tflops is not None and a.flops_per_token is not None:
        step_s, flops, rate = None, a.flops_per_token * tokens, a.achieved_tflops * 1e12
    else:
        return None
    return Compute(step_s, flops, rate, a.activation_checkpointing, a.cpu_adam_params_per_s)


def _check(a: argparse.Namespace) -> None:
    if a.world < 1:
        raise ValueError(f"--world must be >= 1, got {a.world}")
    if a.shard_group_size is not None and (a.shard_group_size < 1 or a.world % a.shard_group_size):
        raise ValueError(
            f"--shard-group-size {a.shard_group_size} does not divide --world {a.world}"
        )
    if a.offload == "params" and a.stage != 3:
        raise ValueError("--offload params needs --stage 3")
    if a.offload_overlap != "none" and a.offload == "none":
        raise ValueError("--offload-overlap needs --offload")
    if a.micro_batch < 1 or (a.seq is not None and a.seq < 1):
        raise ValueError("--micro-batch and --seq must be >= 1")
    if a.snapshots is not None and not a.snapshots > 0:
        raise ValueError(f"--snapshots takes the host memory per node in GiB, got {a.snapshots}")
    if a.memory_limit_gib is not None and not a.memory_limit_gib > 0:
        raise ValueError(f"--memory-limit-gib must be > 0, got {a.memory_limit_gib}")
    if (a.achieved_tflops is None) != (a.flops_per_token is None):
        given, missing = (
            ("--achieved-tflops", "--flops-per-token")
            if a.flops_per_token is None
            else ("--flops-per-token", "--achieved-tflops")
        )
        raise ValueError(f"{given} needs {missing}: the step's compute time is their quotient")
    if a.step_ms is not None and a.achieved_tflops is not None:
        raise ValueError("give --step-ms or --achieved-tflops with --flops-per-token, not both")
    if a.fp8_all_gather and a.fp8 != "tensorwise":
        raise ValueError("--fp8-all-gather needs --fp8 tensorwise (torchao's only recipe for it)")
    if a.layers is not None and (a.layers < 1 or a.model not in PRESETS):
        raise ValueError("--layers takes a count >= 1 and a preset (not a config.json)")
    if a.tp < 1 or a.world % a.tp:
        raise ValueError(f"--tp {a.tp} does not divide --world {a.world}")
    if a.sequence_parallel and a.tp == 1:
        raise ValueError("--sequence-parallel needs --tp above 1")
    if a.tp > 1:
        # What the planner does not price under tensor parallelism, and why.
        taken = [
            f"{flag} ({why})"
            for flag, given, why in (
                (
                    "--memory-limit-gib",
                    a.memory_limit_gib is not None,
                    "the recommendation compares projected peaks, and the split model's "
                    "activations are not traced",
                ),
            )
            if given
        ]
        if taken:
            raise ValueError(f"--tp cannot be combined with {'; '.join(taken)}")


def _snapshot_rows(e: Estimate | TensorParallelPlan, host_gib: float, ranks: int) -> str:
    """What snapshots take of a node's host memory; ValueError when they do not fit."""
    steady, peak = e.snapshot_host
    node = (peak + e.host) * ranks
    offload = f" and offload's {e.host * ranks / GIB:.2f}" if e.host else ""
    text = (
        f"\nsnapshots in host memory per rank: {e.snapshot / GIB:.2f} GiB a copy; "
        f"{steady / GIB:.2f} GiB between snapshots (two slots, pinned, and a replica), "
        f"{peak / GIB:.2f} GiB while one is taken; a node of {ranks} ranks needs "
        f"{node / GIB:.2f} GiB (snapshots{offload}) of its {host_gib:g} GiB"
    )
    if node > host_gib * GIB:
        raise ValueError(
            f"snapshots do not fit in host memory: {text.strip()}. Taking them less often "
            "does not help (two steps are held while one is taken): more nodes, less "
            "offload, or checkpoints on disk only"
        )
    return text


def main(argv: Sequence[str] | None = None) -> int:
    """Print the memory table, the projected step and (with a limit) a recommendation."""
    a = _parser().parse_args(argv)
    try:
        _check(a)
        cfg = _config(a)
        model = build(
            a.model, activation_checkpointing=a.activation_checkpointing, n_layer=a.layers
        )
        if a.fp8 != "none":
            convert_float8(model, a.fp8, a.fp8_all_gather)
        if a.seq is None and a.model not in PRESETS:
            raise ValueError("--seq is needed with a config.json (presets have their own)")
        seq = a.seq or PRESETS[a.model].seq_len
        compute = _compute(a, a.micro_batch * seq)
        if compute is None:
            print(f"({NOT_PRICED}: memory only)")
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
                print(_snapshot_rows(split, a.snapshots, min(a.gpus_per_node, a.world)))
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
            print(_snapshot_rows(first, a.snapshots, min(a.gpus_per_node, a.world)))
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
                print(f"   * speed not priced ({NOT_PRICED}): {MEMORY_ONLY_RULE}")
    except ValueError as e:
        print(f"zeroshard-plan: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
