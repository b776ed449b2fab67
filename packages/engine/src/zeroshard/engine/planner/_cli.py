"""`zeroshard-plan`: memory, step time and a recommended config for a run, before buying it."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from zeroshard.engine.config._config import ZeroConfig
from zeroshard.engine.planner._cluster import Cluster, Link
from zeroshard.engine.planner._estimate import GIB, Estimate, estimate
from zeroshard.engine.planner._groups import plan_groups
from zeroshard.engine.planner._presets import PRESETS, build
from zeroshard.engine.planner._recommend import candidate_configs, recommend
from zeroshard.engine.planner._step_time import Compute


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="zeroshard-plan",
        description="Per-rank memory and projected step time of a zeroshard run.",
    )
    p.add_argument("model", help=f"a preset ({', '.join(PRESETS)}) or a HF config.json path")
    p.add_argument("--world", type=int, required=True, help="GPUs in the run")
    p.add_argument("--micro-batch", type=int, default=1)
    p.add_argument("--seq", type=int, help="sequence length (default: the preset's)")
    p.add_argument("--stage", type=int, default=3, choices=(1, 2, 3))
    p.add_argument("--shard-group-size", type=int, help="hybrid: shard within groups of this size")
    p.add_argument("--offload", choices=("none", "optimizer", "params"), default="none")
    p.add_argument(
        "--offload-overlap",
        choices=("none", "backward", "delayed"),
        default="none",
        help="the CPU step beside backward (step_in_backward) or beside the next forward "
        "and backward (delay_param_update); default: after backward",
    )
    p.add_argument("--dtype", default="bf16", help="compute dtype (bf16, fp16, fp32)")
    p.add_argument("--activation-checkpointing", action="store_true")
    p.add_argument("--prefetch-bytes", type=int, help="stage 3 prefetch bytes")
    p.add_argument("--memory-limit-gib", type=float, help="recommend a config that fits this")
    p.add_argument("--gpus-per-node", type=int, default=8)
    p.add_argument(
        "--internode-gbps", type=float, default=50.0, help="GB/s per GPU (50 = 400 Gb/s)"
    )
    p.add_argument("--internode-latency-us", type=float, default=5.0)
    p.add_argument("--step-ms", type=float, help="measured one-GPU step (no communication), ms")
    p.add_argument("--achieved-tflops", type=float, help="measured achieved TFLOP/s per GPU")
    p.add_argument(
        "--flops-per-token", type=float, help="training FLOPs per token (with the above)"
    )
    p.add_argument("--cpu-adam-params-per-s", type=float, help="measured CPU AdamW rate (offload)")
    return p


def _config(a: argparse.Namespace) -> ZeroConfig:
    extra = {} if a.prefetch_bytes is None else {"prefetch_bytes": a.prefetch_bytes}
    return ZeroConfig.from_dict(
        {
            "stage": a.stage,
            "compute_dtype": a.dtype,
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
    if a.memory_limit_gib is not None and not a.memory_limit_gib > 0:
        raise ValueError(f"--memory-limit-gib must be > 0, got {a.memory_limit_gib}")


def main(argv: Sequence[str] | None = None) -> int:
    """Print the memory table, the projected step and (with a limit) a recommendation."""
    a = _parser().parse_args(argv)
    try:
        _check(a)
        cfg = _config(a)
        model = build(a.model, activation_checkpointing=a.activation_checkpointing)
        if a.seq is None and a.model not in PRESETS:
            raise ValueError("--seq is needed with a config.json (presets have their own)")
        seq = a.seq or PRESETS[a.model].seq_len
        compute = _compute(a, a.micro_batch * seq)
        if compute is None:
            print("(no --step-ms or --achieved-tflops/--flops-per-token: memory only)")
        if a.offload != "none" and compute is not None and a.cpu_adam_params_per_s is None:
            raise ValueError("offload step time needs --cpu-adam-params-per-s (a measured rate)")
        cluster = Cluster(
            a.gpus_per_node,
            internode=Link(a.internode_gbps, a.internode_latency_us),
        )

        def run(c: ZeroConfig, comp: Compute | None = compute) -> Estimate:
            # Every offloaded config steps in backward; one the engine refuses it (stage 1,
            # fp16) raises, as the engine would.
            in_backward = a.offload_overlap == "backward" and c.offload.optimizer
            return estimate(
                model,
                c,
                a.world,
                a.micro_batch,
                seq,
                compute=comp,
                cluster=cluster,
                step_in_backward=in_backward,
            )

        print(run(cfg).table())
        if a.memory_limit_gib is not None:
            stage3 = cfg.replace(stage=3, offload_delay_param_update=False)
            units = plan_groups(model, stage3, 1).units
            largest = max((u.gathered_bytes for u in units if not u.persistent), default=0)
            configs = candidate_configs(cfg, a.world, a.gpus_per_node, largest)
            if compute is not None and compute.cpu_adam_params_per_s is None:
                configs = [c for c in configs if not c.offload.optimizer]
            rec = recommend(configs, run, int(a.memory_limit_gib * GIB))
            print(f"\nrecommendation within {a.memory_limit_gib:g} GiB per GPU:")
            for e in rec.candidates:
                mark = "*" if e is rec.best else " "
                c = e.config
                speed = f"{e.tokens_per_s_per_gpu:,.0f} tok/s/GPU" if e.step else "-"
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
    except ValueError as e:
        print(f"zeroshard-plan: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
