"""Time one training step of a model under several engines in one torchrun launch.

Run from the repository root (`-m` makes `benchmarks` and `examples` importable):

    NCCL_NVLS_ENABLE=0 torchrun --standalone --nproc-per-node=2 -m benchmarks.train_step
    NCCL_NVLS_ENABLE=0 torchrun --standalone --nproc-per-node=2 -m benchmarks.train_step \
        --model llama --preset 7b --profile
    torchrun --standalone --nproc-per-node=1 -m benchmarks.train_step --model hf-llama \
        --engines floor,floor32,floorc,fsdp2,fsdp2c,zs2,zs3,zs3c --rounds 3 --compile-time
    torchrun --standalone --nproc-per-node=2 -m benchmarks.train_step --smoke --model hf-llama
    NCCL_NVLS_ENABLE=0 torchrun --standalone --nproc-per-node=4 -m benchmarks.train_step \
        --model llama --engines zs3,zs3tp,fsdp2,fsdp2tp --tp 2
    torchrun --standalone --nproc-per-node=1 -m benchmarks.train_step --optimizer muon \
        --engines floor32,floor32-adamw,zs2,zs3,ds2,ds3
    torchrun --standalone --nproc-per-node=1 -m benchmarks.train_step \
        --engines floor,zs3-off,zs3c-off --rounds 2 --section train_step_offload_1gpu

Models (`--model`, see `_models.py`): `gpt` (examples/gpt.py), `llama`
(examples/llama.py) and `hf-llama` (`transformers.LlamaForCausalLM` of the same shapes,
built from a config: no download), each at the presets `1.3b` and `7b`.
transformers 5.23.0 goes to a machine without registry access (the GPU image: Python 3.12,
x86_64) as wheels, 43.5 MiB with numpy, 28.5 MiB without; install them there with
`pip install --no-index --find-links .whl transformers==5.23.0`. They are fetched by

    pip download --python-version 3.12 --only-binary=:all: --platform manylinux2014_x86_64 \
        --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 -d .whl \
        transformers==5.23.0

which brings its dependencies along: huggingface-hub, tokenizers, safetensors, regex,
pyyaml, numpy, packaging, tqdm, typer, filelock, fsspec, hf-xet and their own.

Engines (`--engines`, default: every one that can be imported, but those run only when
named): `floor` (the model on ONE device with no communication, on rank 0 while the
others wait), `floor32` (the same with fp32 master weights, the like-for-like floor of
zs1-zs3 at one GPU), `floorc` (the floor with every block under `torch.compile`, the
reference of the compiled engines), `floor32c` (run only when named: `floor32` with its
blocks compiled, zs3c's like-for-like floor), the compile-time peers of zs3c's one graph, run only
when named: `floorw` (the floor compiled whole), `floorr` (that, with every block a
`torch.compiler.nested_compile_region`) and `floorr-memo` (that, with torch's per-call
re-trace of a region memoized: a diagnostic patch of torch), `ddp`, `fsdp2`, `fsdp2c`
(its blocks compiled), `fsdp2-zero2`, `zs1`-`zs3` (zeroshard), `zs3c` (compiled whole),
`zs3b` (zs3 with each block's forward compiled, as fsdp2c), run only when named
`zs2-off`, `zs3-off` and `zs3c-off` (`zs2`, `zs3`, `zs3c` with the optimizer offloaded to
the CPU: the report sets each beside its twin on the device, and `zs3c-off` against
`zs3-off`), `ds1`-`ds3`
(DeepSpeed, always run last), the hybrid `zs2h`, `zs3h`, `fsdp2h` (shard within
`--shard-group-size` ranks, replicate across the rest) and, run only when named, the
tensor-parallel `zs3tp`, `zs3ctp` (compiled) and `fsdp2tp` (`llama` and `hf-llama` split over `--tp`
consecutive ranks by torch's tensor parallelism, sharded over the rest; at `--tp 1`,
`zs3tp` is `zs3` through `initialize(device_mesh=...)` with DTensor layers) and `zs3m`
(`zs3` through a (world, 1) mesh, the model not split). The fp8 engines, run only when
named (torchao's float8 training of every block's linears, by the `--fp8` recipe:
`_float8.py`): the floors `floor8`, `floorc8` and `floor32c8`, `zs3-fp8`, `zs3c-fp8`, `fsdp2-fp8`,
`fsdp2c-fp8`, and with those weights gathered in fp8 (torchao's
`enable_fsdp_float8_all_gather`: zeroshard's fp8 gather, FSDP2's fp8 all-gather)
`zs3-fp8g`, `zs3c-fp8g`, `fsdp2-fp8g`, `fsdp2c-fp8g`; each against its fp8 floor, and
issue 61's goals table compares them with the bf16 engines of the same run. The preset
`wide` (gpt: d 4096, 8 layers, seq 4096) is where fp8 pays most. Each gets the same
freshly built
model (`--activation-checkpointing` recomputes every block in backward, for every
engine), the same random tokens and torch.optim.AdamW (`--optimizer muon`: torch's
recipe, torch.optim.Muon on the hidden matrices and AdamW on the rest, DeepSpeed's own
Muon for `ds*`; `floor32-adamw`, run only when named, is `floor32` with AdamW alone, so a
Muon run shows what Muon's step costs). Per engine:
init time (wrapping, model construction excluded), median step time over `--steps` after
`--warmup` (CUDA-synchronized; the slowest rank), tokens/s/GPU, MFU, peak memory and the
memory kept between steps. An engine that fails gets a row saying why and the run goes on.
`--rounds N` runs every engine N times, in alternating order, and reports the median of
the rounds. `--compile-time` times the compiled engines' cold and warm compile apart from
the steps, in child processes of one rank (`_compile.py`), with their recompiles after
step 2 and the split of each compile into Dynamo, AOTAutograd, zeroshard's passes and
inductor's phases, with the compile caches' hits and misses. `--profile` adds, per
engine, the split of the step into compute, optimizer, exposed communication and idle
time, and of its gap to the floor into (a) exposed communication and (b) compute kernels
slowed by the collectives overlapping them (`_trace.py`).
Every run saves its results and settings to bench-out/<section>.json (what
benchmarks/scaling reads); full runs also write the "<section>" section of
docs/benchmarks.md (default `train_step`, `_<model>` added for llama and hf-llama,
`_<preset>` for any preset but 1.3b, `_muon` with `--optimizer muon`, `_1gpu` in a world
of one) and docs/<section>.png,
`--smoke` and `--no-write` only bench-out/.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

from benchmarks._common import ROOT, SMOKE_OUT, join, place_torchrun_ranks, write_section
from benchmarks._common._models import MODELS, OPTIMIZERS, BenchModel, bench_model
from benchmarks.train_step._compile import CompileTime, cache_dir, measure, probe
from benchmarks.train_step._engines import ENGINES, default_engines
from benchmarks.train_step._plots import plot, plot_split
from benchmarks.train_step._report import report
from benchmarks.train_step._result import Result, save_json
from benchmarks.train_step._run import combine, run_engine, warm_up_process
from benchmarks.train_step._settings import NOTES, Settings

DOCS = ROOT / "docs"
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def parse_args() -> argparse.Namespace:
    """Command-line options."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--engines",
        default=None,
        help="comma-separated; default: all importable but floorw, floorr, floorr-memo",
    )
    p.add_argument("--model", default="gpt", choices=MODELS, help="model family (default gpt)")
    p.add_argument("--preset", default="1.3b", help="the model's preset: 1.3b or 7b")
    p.add_argument("--seq-len", type=int, default=None, help="override the preset's seq_len")
    p.add_argument("--micro-batch", type=int, default=8, help="sequences per GPU per step")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps per engine")
    p.add_argument("--steps", type=int, default=8, help="timed steps per engine")
    p.add_argument("--dtype", default=None, choices=list(DTYPES), help="bf16 (fp32 in --smoke)")
    p.add_argument("--clip", type=float, default=0.0, help="grad-norm clip in every engine")
    p.add_argument(
        "--optimizer",
        default="adamw",
        choices=OPTIMIZERS,
        help="every engine's optimizer: AdamW (default), or muon: torch.optim.Muon on the "
        "hidden matrices and AdamW on the rest (DeepSpeed: its own Muon)",
    )
    p.add_argument(
        "--peak-tflops",
        type=float,
        default=989.0,
        help="per-GPU peak for MFU (default: H100/H200 SXM bf16 dense, 989)",
    )
    p.add_argument("--zs-config", default="{}", help="JSON merged into the zeroshard config")
    p.add_argument(
        "--fp8",
        default="tensorwise",
        choices=("tensorwise", "rowwise"),
        help="torchao recipe of the fp8 engines (floor8, zs3c-fp8, ...; default tensorwise)",
    )
    p.add_argument(
        "--shard-group-size",
        type=int,
        default=2,
        help="hybrid engines (zs2h, zs3h, fsdp2h): shard within this many ranks (default 2)",
    )
    p.add_argument(
        "--tp",
        type=int,
        default=1,
        help="tensor-parallel engines (zs3tp, fsdp2tp): split each layer over this many "
        "consecutive ranks, shard over the rest (default 1)",
    )
    p.add_argument(
        "--activation-checkpointing",
        action="store_true",
        help="recompute each block in backward (non-reentrant torch.utils.checkpoint), all engines",
    )
    p.add_argument(
        "--profile",
        action="store_true",
        help="profile 2 extra steps per engine: exposed communication, idle time",
    )
    p.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="run every engine this many times, in alternating order; report the median",
    )
    p.add_argument(
        "--compile-time",
        action="store_true",
        help="time the compiled engines' cold and warm compile apart, in child processes",
    )
    # A child process of --compile-time: NAME=PATH, one engine's probe written to PATH.
    p.add_argument("--compile-probe", default=None, help=argparse.SUPPRESS)
    p.add_argument("--smoke", action="store_true", help="tiny model on CPU/gloo, bench-out only")
    p.add_argument("--no-write", action="store_true", help="print the table, write no docs")
    p.add_argument(
        "--section",
        default=None,
        help="docs/benchmarks.md section (default: train_step[_<model>][_<preset>])",
    )
    args = p.parse_args()
    unknown = sorted(set((args.engines or "").split(",")) - set(ENGINES) - {""})
    if unknown:
        p.error(f"unknown engine(s) {', '.join(unknown)}; valid: {', '.join(ENGINES)}")
    try:
        model_of(args)  # only shapes: an unknown preset or a bad --seq-len is an option error
    except ValueError as e:
        p.error(str(e))
    if args.section is None:
        model = "" if args.model == "gpt" else f"_{args.model}"
        preset = "" if args.preset == "1.3b" else f"_{args.preset}"
        # One GPU has sections of its own: the 2-GPU ones (no suffix) stay as measured.
        one = "_1gpu" if os.environ.get("WORLD_SIZE", "1") == "1" else ""
        muon = "_muon" if args.optimizer == "muon" else ""
        args.section = f"train_step{model}{preset}{muon}{one}".replace("-", "_").replace(".", "_")
    if args.rounds < 1:
        p.error(f"--rounds must be a positive integer, got {args.rounds}")
    if args.compile_probe is not None and "=" not in args.compile_probe:
        p.error(f"--compile-probe takes ENGINE=PATH, got {args.compile_probe!r}")
    if args.shard_group_size < 1:
        p.error(f"--shard-group-size must be a positive integer, got {args.shard_group_size}")
    if args.tp < 1:
        p.error(f"--tp must be a positive integer, got {args.tp}")
    return args


def model_of(args: argparse.Namespace) -> BenchModel:
    """The benchmarked model: `--model` at `--preset`, or a tiny one under --smoke."""
    return bench_model(
        args.model,
        args.preset,
        smoke=args.smoke,
        seq_len=args.seq_len,
        activation_checkpointing=args.activation_checkpointing,
    )


def round_order(names: list[str], index: int) -> list[str]:
    """The engines of round `index`: as listed in even rounds, reversed in odd ones, so no
    engine always runs after the same one; those that run last stay last."""
    first = [n for n in names if not ENGINES[n].runs_last]
    last = [n for n in names if ENGINES[n].runs_last]
    return (first if index % 2 == 0 else first[::-1]) + last


def _progress(name: str, index: int, rounds: int, r: Result, seconds: float) -> None:
    state = (
        r.error
        or (r.skipped and f"skipped: {r.skipped}")
        or (
            f"{r.step_ms:.1f} ms/step, init {r.init_s:.2f} s, build {r.build_s:.1f} s, "
            f"peak {r.peak_gib or 0:.1f} GiB, states {r.states_gib or 0:.1f} GiB"
        )
    )
    state += f", {r.left_gib:.2f} GiB left allocated" if r.left_gib else ""
    where = f" (round {index + 1}/{rounds})" if rounds > 1 else ""
    print(f"[train_step] {name}{where}: {state} ({seconds:.0f} s)", flush=True)


def main() -> None:
    """Run every chosen engine in turn and write the report on rank 0."""
    args = parse_args()
    # DeepSpeed still calls the flat collectives by their pre-2.13 names: one warning each.
    warnings.filterwarnings("ignore", message=r".*torch\.distributed\.\w+` is deprecated")
    if "RANK" not in os.environ:  # plain `python -m benchmarks.train_step`: a world of one
        os.environ.update(
            RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1"
        )
        os.environ.setdefault("MASTER_PORT", "29517")
    placement = place_torchrun_ranks(smoke=args.smoke)
    device = join(placement)
    rank, world = dist.get_rank(), dist.get_world_size()
    if rank == 0:
        print(f"[train_step] ranks: {placement.describe()}", flush=True)
    dtype = DTYPES[args.dtype or ("fp32" if args.smoke else "bf16")]
    if args.smoke:
        args.micro_batch, args.warmup, args.steps = 2, 1, 2
    bm = model_of(args)
    settings = Settings(
        device,
        dtype,
        args.clip,
        args.micro_batch,
        json.loads(args.zs_config),
        args.shard_group_size,
        args.fp8,
        args.tp,
        args.optimizer,
    )
    names = args.engines.split(",") if args.engines else default_engines()
    # DeepSpeed last (a stable sort keeps the order otherwise): see `Engine.runs_last`.
    names.sort(key=lambda n: ENGINES[n].runs_last)
    g = torch.Generator().manual_seed(1234)
    tokens = torch.randint(0, bm.vocab_size, (args.micro_batch, bm.seq_len + 1), generator=g)
    data = (tokens[:, :-1].to(device), tokens[:, 1:].to(device))

    warm_up_process(device)
    if args.compile_probe is not None:  # a child of --compile-time: one engine, then out
        name, out = args.compile_probe.split("=", 1)
        probe(name, bm, settings, data, Path(out))
        dist.destroy_process_group()
        return
    cache_root: Path | None = None
    compile_times: list[CompileTime] = []
    if args.compile_time and rank == 0:
        cache_root = Path(tempfile.mkdtemp(prefix="train_step_inductor_"))
        compile_times = measure(names, cache_root)
    dist.barrier()  # the other ranks wait while rank 0's children compile
    rounds: dict[str, list[Result]] = {name: [] for name in names}
    for index in range(args.rounds):
        last_round = index == args.rounds - 1
        for name in round_order(names, index):
            if cache_root is not None and ENGINES[name].compiled:
                # Warm from this engine's probes: its warm-up steps need not compile cold.
                os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(cache_dir(cache_root, name))
            t0 = time.perf_counter()
            r = run_engine(name, bm, settings, args, data, profiled=args.profile and last_round)
            rounds[name].append(r)
            if rank == 0:
                _progress(name, index, args.rounds, r, time.perf_counter() - t0)
                # Saved after every engine: a run cut short by a time limit keeps what it
                # measured.
                results = [combine(rs) for rs in rounds.values() if rs]
                save_json(results, bm, args, settings, world, placement.describe(), compile_times)
    results = [combine(rs) for rs in rounds.values()]
    if cache_root is not None:
        shutil.rmtree(cache_root, ignore_errors=True)

    if rank == 0:
        body = report(results, bm, args, settings, placement.describe(), world, compile_times)
        if NOTES:
            body += "\n\n" + "\n".join(f"- `{name}`: {note}." for name, note in NOTES.items())
        print(body)
        title = f"{bm.name} {bm.preset}: {args.section}"
        if args.smoke or args.no_write:
            plot(results, SMOKE_OUT / f"{args.section}.png", title)
            plot_split(results, SMOKE_OUT / f"{args.section}_split.png", title)
        else:
            png = DOCS / f"{args.section}.png"
            if plot(results, png, title):
                body += f"\n\n![step time and peak memory per engine]({png.name})"
            split = DOCS / f"{args.section}_split.png"
            if plot_split(results, split, title):
                body += (
                    "\n\n![step time split into compute, optimizer, exposed communication "
                    f"and the rest, per engine]({split.name})"
                )
            where = " on one GPU" if world == 1 else ""
            title = f"Training step ({bm.name}){where}: zeroshard vs DDP, FSDP2, DeepSpeed"
            if args.section != "train_step":
                title += f" ({args.section})"
            write_section(args.section, title, body, ranks=placement.describe())
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
