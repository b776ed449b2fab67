"""The generated sections of docs/scaling.md: the NVLink fit, the planner against the
measured runs, the projection to 1,024 GPUs and the planner's recommendation."""

from __future__ import annotations

import contextlib
import io
import json
import re
from dataclasses import dataclass

import torch
from torch import nn

from benchmarks._common import DOC, RESULTS, ROOT, pyplot
from zeroshard.engine import ZeroConfig, estimate
from zeroshard.engine.planner import _cli as plan_cli
from zeroshard.engine.planner._cluster import Cluster, Link, fit_link
from zeroshard.engine.planner._groups import plan_groups
from zeroshard.engine.planner._presets import PRESETS, build
from zeroshard.engine.planner._step_time import Compute
from zeroshard.engine.planner._tensor_parallel import plan_tensor_parallel

SCALING_DOC = ROOT / "docs" / "scaling.md"
GIB = 2**30
ENGINES = {"zs2": 2, "zs3": 3, "zs2h": 2, "zs3h": 3}
PREFETCH = 4 * GIB
WORLDS = (8, 16, 64, 256, 1024)


def nvlink_fit() -> Link:
    """alpha and bandwidth fitted to the raw 2-GPU all-gather/reduce-scatter curves."""
    data = json.loads((RESULTS / "nccl_raw_2gpu.json").read_text())
    sizes, seconds = [], []
    for row in data["results"]:
        moved = row["size_mib"] * 2**20 / 2  # (n-1)/n of the size at n = 2
        sizes.append(int(moved))
        seconds.append(moved / (row["raw_bus_gbps"] * 1e9))
    return fit_link(sizes, seconds)


def _pct(est: float, meas: float) -> str:
    return f"{(est - meas) / meas * 100:+.1f}%"


def validation() -> str:
    rows = [
        "| run (file) | engine | GPUs | kept GiB est / meas | peak GiB est / meas | "
        "step ms est / meas |",
        "|---|---|---|---|---|---|",
    ]
    sources = set()
    for path in sorted(RESULTS.glob("scale_*.json")):
        data = json.loads(path.read_text())
        meta = data["meta"]
        sources.add(f"{meta['device']}, {meta['date']}, torch {meta['torch']}")
        by = {r["engine"]: r for r in data["results"]}
        single = _one_gpu_steps(meta["preset"])
        ac = bool(meta["activation_checkpointing"])
        model = build(meta["preset"], activation_checkpointing=ac)
        for engine, stage in ENGINES.items():
            r = by.get(engine)
            if r is None or r.get("error") or r.get("skipped"):
                continue
            shard = meta["shard_group_size"] if engine.endswith("h") else None
            step_s = single[engine.removesuffix("h")]
            cfg = ZeroConfig.from_dict(
                {"stage": stage, "compute_dtype": "bf16", "shard_group_size": shard}
            )
            e = estimate(
                model,
                cfg,
                meta["world"],
                meta["micro_batch"],
                meta["seq_len"],
                compute=Compute(step_s=step_s, recompute=ac),
            )
            assert e.step is not None
            kept, peak, ms = e.states_total / GIB, e.peak / GIB, e.step.total_s * 1e3
            label = " (input)" if meta["world"] == 1 else ""
            rows.append(
                f"| {path.name} | `{engine}` | {meta['world']} | "
                f"{kept:.1f} / {r['states_gib']:.1f} ({_pct(kept, r['states_gib'])}) | "
                f"{peak:.1f} / {r['peak_gib']:.1f} ({_pct(peak, r['peak_gib'])}) | "
                f"{ms:.0f} / {r['step_ms']:.0f} ({_pct(ms, r['step_ms'])}){label} |"
            )
    head = (
        "Measured: " + "; ".join(sorted(sources)) + " (benchmarks/results/scale_*.json, an "
        "earlier commit of the engine, AdamW, bf16). Estimated on a CPU by this tree. The "
        "compute figure of every row is the same engine's measured 1-GPU step "
        "(scale_<preset>_1gpu.json), so the 1-GPU step times are inputs, not predictions; "
        "memory is predicted in every row. Validation against the current "
        "tree on GPUs is still to be run; no 8-GPU machine was lent, so there are no "
        "8-GPU rows.\n\n"
    )
    return head + "\n".join(rows)


# A training row of an offload section: label, stage, params, step s, GPU and host peak GiB.
_OFFLOAD_ROW = re.compile(
    r"^\| (zeroshard offload_optimizer[^|]*) \(stage (\d)\) \| ([\d.]+)B \| ([\d.]+)[^|]* \| "
    r"[\d,]+ \| ([\d.]+) \| ([\d.]+) \|",
    re.M,
)


def _offload_sections() -> list[tuple[str, str]]:
    """(name, body) of each offload section of docs/benchmarks.md with each resource alone
    beside the rows, measured since 664620e (the fp32 masters go up, or with offload_params
    the compute-dtype shards): its transfer line names the upload's dtype."""
    text = DOC.read_text()
    out = []
    for name in re.findall(r"<!-- (offload[\w-]*):start -->", text):
        body = text.split(f"<!-- {name}:start -->")[1].split(f"<!-- {name}:end -->")[0]
        if "Each resource alone" in body and re.search(r"up in (float32|bfloat16)", body):
            out.append((name, body))
    return out


def offload_validation() -> str:
    """GPU and host memory and the step of the offload runs in docs/benchmarks.md, each
    estimated from that run's GPU forward + backward and CPU AdamW measured alone."""
    rows = [
        "| section (docs/benchmarks.md) | measured on | params | zeroshard | "
        "GPU peak GiB est / meas | host GiB est / meas (RSS) | step s est / meas |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, body in _offload_sections():
        on = re.search(r"Measured (\S+) on 1 x ([^;(]+)", body)
        shape = re.search(r"(\d+) blocks, seq (\d+), micro-batch (\d+)", body)
        gpu_s = re.search(r"GPU forward \+ backward ([\d.]+) s", body)
        cpu = re.search(r"CPU AdamW ([\d.]+) s \(torch fused over ([\d.]+)B parameters", body)
        assert on and shape and gpu_s and cpu, f"section {name} changed shape"
        layers, seq, mb = (int(x) for x in shape.groups())
        model = build("7b", activation_checkpointing=True, n_layer=layers)
        rate = float(cpu[2]) * 1e9 / float(cpu[1])
        compute = Compute(step_s=float(gpu_s[1]), recompute=True, cpu_adam_params_per_s=rate)
        for row in _OFFLOAD_ROW.finditer(body):
            label = row[1]
            if "clip_grad_norm_" in label:
                continue  # the model has no clipping
            ratio = re.search(r"offload_ratio ([\d.]+)", label)
            cfg = ZeroConfig.from_dict(
                {
                    "stage": int(row[2]),
                    "compute_dtype": "bf16",
                    "offload_optimizer": True,
                    "offload_ratio": float(ratio[1]) if ratio else 1.0,
                    "offload_params": "offload_params" in label,
                    "offload_delay_param_update": "delay_param_update" in label,
                    # benchmarks/offload's `-bf16` rows (their label says so).
                    "master_dtype": "bf16" if "bf16 masters" in label else "fp32",
                }
            )
            e = estimate(
                model,
                cfg,
                1,
                mb,
                seq,
                compute=compute,
                step_in_backward="step_in_backward" in label,
            )
            assert e.step is not None
            step, gpu, host = float(row[4]), float(row[5]), float(row[6])
            what = label.removeprefix("zeroshard offload_optimizer").lstrip(", ") or "serial"
            rows.append(
                f"| {name} | 1 x {on[2].strip()}, {on[1]} | {row[3]}B | {what} | "
                f"{e.peak / GIB:.1f} / {gpu:.1f} ({_pct(e.peak / GIB, gpu)}) | "
                f"{e.host / GIB:.1f} / {host:.1f} | "
                f"{e.step.total_s:.2f} / {step:.2f} ({_pct(e.step.total_s, step)}) |"
            )
    return (
        "Offload, one GPU, GPT `7b` width, activation checkpointing, bf16, AdamW: the runs "
        "of docs/benchmarks.md's offload sections that measured each resource alone with "
        "the engine's current upload (the fp32 masters go up, with `offload_params` the "
        "bf16 shards). Each step is estimated from "
        "that run's own GPU forward + backward and torch's fused CPU AdamW rate "
        "([Note: the offload model] in the planner's _step_time.py). The GPU figure "
        "leaves out the device share's optimizer step of an `offload_ratio` below 1. The "
        "host figure measured is the process's peak resident memory (ru_maxrss: CUDA and "
        "torch libraries, the model built for initialization and allocator slack included), "
        "so only the estimate's host buffers are comparable, not equal.\n\n" + "\n".join(rows)
    )


# The GPU run that validates the step under tensor parallelism; its bench-out JSON goes
# to benchmarks/results/tp_<preset>_<world>gpu.json.
TP_COMMAND = (
    "NCCL_NVLS_ENABLE=0 torchrun --standalone --nproc-per-node=2 -m benchmarks.train_step "
    "--model llama --preset 1.3b --micro-batch 4 --activation-checkpointing "
    "--engines floor32,zs3,zs3tp --tp 2 --rounds 3 --section tp_1.3b_2gpu"
)


def tp_validation() -> str:
    """The projected step under tensor parallelism ([Note: the step under tensor
    parallelism] in the planner's _step_time.py) against the tp engines of
    benchmarks/results/tp_*.json, each from that run's own one-GPU `floor32` step."""
    from examples import llama

    rows = [
        "| run (file) | engine | GPUs | tp | states GiB est / meas | step ms est / meas |",
        "|---|---|---|---|---|---|",
    ]
    sources = set()
    for path in sorted(RESULTS.glob("tp_*.json")):
        data = json.loads(path.read_text())
        meta = data["meta"]
        by = {r["engine"]: r for r in data["results"] if r.get("step_ms")}
        if meta["model_name"] != "llama" or "floor32" not in by:
            continue
        sources.add(f"{meta['device']}, {meta['date']}, torch {meta['torch']}")
        ac = bool(meta["activation_checkpointing"])
        compute = Compute(step_s=by["floor32"]["step_ms"] / 1e3, recompute=ac)
        cfg = ZeroConfig.from_dict(
            {"stage": 3, "compute_dtype": meta["dtype"], **(meta["zs_config"] or {})}
        )
        for engine in ("zs3tp", "zs3ctp"):
            r = by.get(engine)
            if r is None:
                continue
            with torch.device("meta"):
                model = llama.Llama(llama.LlamaConfig(**meta["model"]))
            plan = plan_tensor_parallel(
                model,
                cfg,
                world_size=meta["world"],
                tp=r["tp"],
                micro_batch=meta["micro_batch"],
                seq_len=meta["seq_len"],
                sequence_parallel=False,
                cluster=Cluster(),
                compute=compute,
            )
            assert plan.step is not None
            kept, ms = sum(plan.states.values()) / GIB, plan.step.total_s * 1e3
            rows.append(
                f"| {path.name} | `{engine}` | {meta['world']} | {r['tp']} | "
                f"{kept:.1f} / {r['states_gib']:.1f} ({_pct(kept, r['states_gib'])}) | "
                f"{ms:.0f} / {r['step_ms']:.0f} ({_pct(ms, r['step_ms'])}) |"
            )
    if len(rows) == 2:
        return (
            "Tensor parallelism: not yet measured. The projected step under `--tp` (1/tp "
            "of the one-GPU compute, the tp collectives on the critical path) awaits a GPU "
            f"run: `{TP_COMMAND}`, its `bench-out/tp_1.3b_2gpu.json` copied to "
            "benchmarks/results/, then this script."
        )
    return (
        "Tensor parallelism, examples/llama.py split by Megatron's plan, stage 3 over the "
        "rest. Measured: " + "; ".join(sorted(sources)) + " (benchmarks/results/tp_*.json, "
        f"from `{TP_COMMAND}` or its like). Each step is estimated from the same run's "
        "one-GPU `floor32` step (no communication, fp32 masters) as the compute figure "
        "([Note: the step under tensor parallelism] in the planner's _step_time.py).\n\n"
        + "\n".join(rows)
    )


def _one_gpu_steps(preset: str) -> dict[str, float]:
    """Seconds per step of each engine measured on one GPU for `preset`."""
    data = json.loads((RESULTS / f"scale_{preset}_1gpu.json").read_text())
    return {r["engine"]: r["step_ms"] / 1e3 for r in data["results"] if r.get("step_ms")}


def _flops_per_token(name: str, seq: int) -> float:
    """6 N (matmul parameters, head included, lookups excluded) + 12 n_layer d seq (PaLM)."""
    s = PRESETS[name]
    model = build(name, activation_checkpointing=True)
    n = sum(p.numel() for p in model.parameters())
    # gpt: the tied embedding counts once, as the head; the position lookup is free.
    # llama: the token lookup is free, the untied head is a matmul.
    n -= s.seq_len * s.d_model if s.family == "gpt" else s.vocab_size * s.d_model
    return 6 * n + 12 * s.n_layer * s.d_model * seq


@dataclass(frozen=True)
class _Point:
    model: str
    world: int
    sharding: str
    peak_gib: float
    step_ms: float
    tokens: float
    bound: str


def _largest_unit_gib(model: nn.Module) -> float:
    plan = plan_groups(model, ZeroConfig.from_dict({"stage": 3, "compute_dtype": "bf16"}), 1)
    return max(u.gathered_bytes for u in plan.units if not u.persistent) / GIB


def projections() -> str:
    base = json.loads((RESULTS / "scale_7b_1gpu.json").read_text())
    meta = base["meta"]
    zs3 = next(r for r in base["results"] if r["engine"] == "zs3")
    tokens = meta["micro_batch"] * meta["seq_len"]
    rate = meta["flops_per_token"] * tokens / (zs3["step_ms"] / 1e3)
    points: list[_Point] = []
    block = 0.0
    for name, mb, seq, shards in (
        ("7b", 4, 2048, (None, 8)),
        ("llama-70b", 1, 4096, (None, 8, 32)),
    ):
        model = build(name, activation_checkpointing=True)
        block = max(block, _largest_unit_gib(model))
        compute = Compute(
            flops_per_step=_flops_per_token(name, seq) * mb * seq, flops_per_s=rate, recompute=True
        )
        for world in WORLDS:
            for shard in shards:
                if shard is not None and shard >= world:
                    continue
                cfg = ZeroConfig.from_dict(
                    {
                        "stage": 3,
                        "compute_dtype": "bf16",
                        "shard_group_size": shard,
                        "prefetch_bytes": PREFETCH,
                    }
                )
                e = estimate(model, cfg, world, mb, seq, compute=compute, cluster=Cluster())
                assert e.step is not None and e.tokens_per_s_per_gpu is not None
                what = "full" if shard is None else f"hybrid {shard}"
                points.append(
                    _Point(
                        name,
                        world,
                        what,
                        e.peak / GIB,
                        e.step.total_s * 1e3,
                        e.tokens_per_s_per_gpu,
                        e.step.bound,
                    )
                )
    head = (
        f"Compute: achieved {rate / 1e12:.0f} TFLOP/s per GPU, from the `zs3` row of "
        f"scale_7b_1gpu.json ({meta['device']}, {meta['date']}: 7b, micro-batch "
        f"{meta['micro_batch']} x {meta['seq_len']}, activation checkpointing), applied to "
        "both models' FLOPs (6 N + 12 L d s per token). Links: NVLink as fitted, 8 GPUs per "
        "node, 50 GB/s (400 Gb/s) and 5 us per hop between nodes. Stage 3, bf16, AdamW, "
        f"activation checkpointing, prefetch_bytes {PREFETCH // GIB} GiB (a llama-70b "
        f"block gathers {block:.2f} GiB: the default 1 GiB would turn prefetch "
        "off), micro-batch 4 x 2048 (7b) and 1 x 4096 (llama-70b). `hybrid k`: shard "
        "within k consecutive GPUs, replicate across the rest.\n\n"
    )
    rows = [
        "| model | GPUs | sharding | peak GiB | step ms | tokens/s/GPU | bound |",
        "|---|---|---|---|---|---|---|",
    ]
    rows += [
        f"| {p.model} | {p.world} | {p.sharding} | {p.peak_gib:.1f} | {p.step_ms:.0f} | "
        f"{p.tokens:,.0f} | {p.bound} |"
        for p in points
    ]
    drawn = _plot(points)
    return (
        head
        + "\n".join(rows)
        + "\n\n"
        + _where_it_stops(points)
        + ("\n\n![projected tokens/s/GPU against GPUs](planning.png)" if drawn else "")
    )


def _where_it_stops(points: list[_Point]) -> str:
    """One line per model and sharding: where the projection leaves compute-bound."""
    lines = ["Where each stops scaling (from the table above):", ""]
    for key in dict.fromkeys((p.model, p.sharding) for p in points):
        run = [p for p in points if (p.model, p.sharding) == key]
        first = next((p for p in run if p.bound != "compute"), None)
        mem = f"peak {run[0].peak_gib:.1f} -> {run[-1].peak_gib:.1f} GiB per GPU"
        if first is None:
            lines.append(f"- {key[0]}, {key[1]}: compute-bound up to {run[-1].world} GPUs; {mem}.")
        else:
            lines.append(
                f"- {key[0]}, {key[1]}: {first.bound}-bound from {first.world} GPUs "
                f"({first.tokens:,.0f} tokens/s/GPU there, {run[-1].tokens:,.0f} at "
                f"{run[-1].world}); {mem}."
            )
    return "\n".join(lines)


def _plot(points: list[_Point]) -> bool:
    """docs/planning.png from `points`; False where matplotlib is missing (no figure)."""
    plt = pyplot()
    if plt is None:
        return False
    fig, ax = plt.subplots(1, 2, figsize=(11, 4))
    for i, model in enumerate(dict.fromkeys(p.model for p in points)):
        for sharding in dict.fromkeys(p.sharding for p in points if p.model == model):
            run = [p for p in points if p.model == model and p.sharding == sharding]
            label = f"{sharding} (peak {run[0].peak_gib:.0f} -> {run[-1].peak_gib:.0f} GiB)"
            ax[i].plot([p.world for p in run], [p.tokens for p in run], "o-", label=label)
        ax[i].set(xscale="log", xlabel="GPUs", ylabel="projected tokens/s/GPU", title=model)
        ax[i].set_ylim(bottom=0)
        ax[i].legend()
    fig.tight_layout()
    fig.savefig(SCALING_DOC.with_name("planning.png"), dpi=90)
    return True


def _cpu_adam_rate() -> tuple[float, str]:
    """Params/s of torch's fused CPU AdamW from the offload section of docs/benchmarks.md."""
    body = DOC.read_text().split("<!-- offload:start -->")[1]
    on = re.search(r"Measured (\S+) on 1 x ([^;]+);", body)
    m = re.search(r"\| torch AdamW fused=True \(CPU\) \| [^|]+ \| ([\d,]+)M \|", body)
    assert on and m, "the offload section of docs/benchmarks.md changed shape"
    return float(m[1].replace(",", "")) * 1e6, f"host of 1 x {on[2]}, {on[1]}"


def recommendation() -> str:
    """The CLI's own output for llama-70b on 64 GPUs within an 80 GiB limit."""
    base = json.loads((RESULTS / "scale_7b_1gpu.json").read_text())
    meta = base["meta"]
    zs3 = next(r for r in base["results"] if r["engine"] == "zs3")
    rate = meta["flops_per_token"] * meta["micro_batch"] * meta["seq_len"] / (zs3["step_ms"] / 1e3)
    cpu, where = _cpu_adam_rate()
    argv = [
        "llama-70b",
        "--world",
        "64",
        "--micro-batch",
        "1",
        "--seq",
        "4096",
        "--activation-checkpointing",
        "--memory-limit-gib",
        "80",
        "--achieved-tflops",
        f"{rate / 1e12:.1f}",
        "--flops-per-token",
        f"{_flops_per_token('llama-70b', 4096):.4g}",
        "--cpu-adam-params-per-s",
        f"{cpu:.4g}",
    ]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert plan_cli.main(argv) == 0
    return (
        f"`zeroshard-plan {' '.join(argv)}` (achieved TFLOP/s as in the projection; CPU "
        f"AdamW rate from the offload section of docs/benchmarks.md, {where}; 80 GiB is an "
        "example limit):\n\n```\n" + out.getvalue().rstrip() + "\n```"
    )
