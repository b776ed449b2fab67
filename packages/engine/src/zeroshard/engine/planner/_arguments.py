"""What `zeroshard-plan` accepts: its arguments, their checks, and the config and compute
figure they describe (`_cli.py` builds and prints the plan from them)."""

from __future__ import annotations

import argparse
import importlib.metadata
import re

import torch

from zeroshard.engine.config._config import ZeroConfig
from zeroshard.engine.planner._presets import PRESETS
from zeroshard.engine.planner._step_time import Compute


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


def parser() -> argparse.ArgumentParser:
    """The command's arguments, each with its help and default."""
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
    p.add_argument(
        "--full-every",
        type=int,
        default=1,
        metavar="K",
        help="with --snapshots: a full snapshot every K steps and a gradient journal entry "
        "at each step between (Snapshots(full_every=K); default 1: full snapshots only)",
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


def config(a: argparse.Namespace) -> ZeroConfig:
    """The `ZeroConfig` the arguments `a` describe."""
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


def compute(a: argparse.Namespace, tokens: int) -> Compute | None:
    """The compute figure the arguments `a` give for a micro-batch of `tokens` tokens
    (None: none given, memory only)."""
    if a.step_ms is not None:
        step_s, flops, rate = a.step_ms / 1e3, None, None
    elif a.achieved_tflops is not None and a.flops_per_token is not None:
        step_s, flops, rate = None, a.flops_per_token * tokens, a.achieved_tflops * 1e12
    else:
        return None
    return Compute(step_s, flops, rate, a.activation_checkpointing, a.cpu_adam_params_per_s)


def check(a: argparse.Namespace) -> None:
    """ValueError naming the argument, where the arguments `a` contradict each other."""
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
    if a.full_every < 1 or (a.full_every > 1 and a.snapshots is None):
        raise ValueError(f"--full-every takes K >= 1 with --snapshots, got {a.full_every}")
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
