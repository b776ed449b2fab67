"""Time one training step of a model under several engines in one torchrun launch.

Run from the repository root (`-m` makes `benchmarks` and `examples` importable):

    NCCL_NVLS_ENABLE=0 torchrun --standalone --nproc-per-node=2 -m benchmarks.train_step
    NCCL_NVLS_ENABLE=0 torchrun --standalone --nproc-per-node=2 -m benchmarks.train_step \
        --model llama --preset 7b --profile
    torchrun --standalone --nproc-per-node=2 -m benchmarks.train_step --smoke --model hf-llama

Models (`--model`, see benchmarks/_models.py): `gpt` (examples/gpt.py), `llama`
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

Engines (`--engines`, default: every one that can be imported): `floor` (the model on ONE
device with no communication, on rank 0 while the others wait), `floorc` (the floor with
every block under `torch.compile`, the reference of the compiled engines), `ddp`, `fsdp2`,
`fsdp2-zero2`, `zs1`-`zs3` (zeroshard), `ds1`-`ds3` (DeepSpeed, always run last) and the
hybrid `zs2h`, `zs3h`, `fsdp2h` (shard within `--shard-group-size` ranks, replicate across
the rest). Each gets the same freshly built model (`--activation-checkpointing` recomputes
every block in backward, for every engine), the same random tokens and
torch.optim.AdamW. Per engine: init time (wrapping, model construction excluded), median
step time over `--steps` after `--warmup` (CUDA-synchronized; the slowest rank),
tokens/s/GPU, MFU, peak memory and the memory kept between steps. An engine that fails
gets a row saying why and the run goes on.
Compiled engines (`floorc`, `zs3c`, `zs3c-nofuse`, `fsdp2c`) also get a note with their
compile time, apart from the steps (the first step less a median one, split into Dynamo,
inductor and the rest by torch's compile timers), and the graphs Dynamo compiled after
step 2 (recompiles; there should be none). Run twice with the same TORCHINDUCTOR_CACHE_DIR
for the warm-cache time; a fresh directory gives the cold one.
`--profile` adds, per engine, the split of the step into compute, optimizer, exposed
communication and idle time, and of its gap to the floor into (a) exposed communication
and (b) compute kernels slowed by the collectives overlapping them (benchmarks/_trace.py).
Every run saves its results and settings to bench-out/<section>.json (what
benchmarks/scaling.py reads); full runs also write the "<section>" section of
docs/benchmarks.md (default `train_step`, `_<model>` added for llama and hf-llama,
`_<preset>` for any preset but 1.3b) and docs/<section>.png, `--smoke` and `--no-write`
only bench-out/.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import statistics
import time
import traceback
import warnings
from dataclasses import asdict
from pathlib import Path
from typing import NamedTuple

import torch
import torch.distributed as dist

from benchmarks._models import MODELS, BenchModel, bench_model
from benchmarks._report import ROOT, command, write_section
from benchmarks._trace import TraceSummary
from benchmarks._train_engines import COMPILED, ENGINES, NOTES, Settings, Skipped
from benchmarks._train_profile import profile
from benchmarks._train_report import Result, plot, plot_split, report

OUT = ROOT / "bench-out"
DOCS = ROOT / "docs"
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
GIB = 1024**3


def parse_args() -> argparse.Namespace:
    """Command-line options."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--engines", default=None, help="comma-separated; default: all importable")
    p.add_argument("--model", default="gpt", choices=MODELS, help="model family (default gpt)")
    p.add_argument("--preset", default="1.3b", help="the model's preset: 1.3b or 7b")
    p.add_argument("--seq-len", type=int, default=None, help="override the preset's seq_len")
    p.add_argument("--micro-batch", type=int, default=8, help="sequences per GPU per step")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps per engine")
    p.add_argument("--steps", type=int, default=8, help="timed steps per engine")
    p.add_argument("--dtype", default=None, choices=list(DTYPES), help="bf16 (fp32 in --smoke)")
    p.add_argument("--clip", type=float, default=0.0, help="grad-norm clip in every engine")
    p.add_argument(
        "--peak-tflops",
        type=float,
        default=989.0,
        help="per-GPU peak for MFU (default: H100/H200 SXM bf16 dense, 989)",
    )
    p.add_argument("--zs-config", default="{}", help="JSON merged into the zeroshard config")
    p.add_argument(
        "--shard-group-size",
        type=int,
        default=2,
        help="hybrid engines (zs2h, zs3h, fsdp2h): shard within this many ranks (default 2)",
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
        args.section = f"train_step{model}{preset}".replace("-", "_").replace(".", "_")
    if args.shard_group_size < 1:
        p.error(f"--shard-group-size must be a positive integer, got {args.shard_group_size}")
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


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _free(device: torch.device) -> None:
    # Drop every reference cycle (engines and hooks form them) before the cache is emptied,
    # so the next engine starts from the same empty device.
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _agree(values: list[float], ok: bool, error: str | None) -> tuple[list[float], str | None]:
    """Max of `values` over ranks (the slowest rank), and the first rank's error if any."""
    t = torch.tensor([*values, 0.0 if ok else 1.0], dtype=torch.float64)
    if dist.get_backend() == "nccl":
        t = t.cuda()
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    errors: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(errors, error)
    first = next((e for e in errors if e), None)
    failed = t[-1].item() > 0
    return t[:-1].tolist(), (first or "failed on another rank") if failed else None


class Measured(NamedTuple):
    """One engine's figures on this rank."""

    build_s: float  # constructing the model on the device, before any engine sees it
    init_s: float
    times: list[float]
    peak_gib: float  # max allocated from wrapping to the last step
    states_gib: float  # allocated after the last step above the level before the build
    trace: TraceSummary | None


# torch's compile timers (seconds, summed over the process), to split compile time into
# Dynamo's trace of the Python code, inductor (lowering, code generation, kernel
# compilation; backward's too, whether compiled with forward or at the first backward) and
# the rest (AOTAutograd's joint trace and partition, zeroshard's passes, guards).
_TIMERS = {"dynamo": "bytecode_tracing", "inductor": "compile_fx_inner"}


def _compile_counters() -> dict[str, float]:
    """torch's compile timers (see _TIMERS) and Dynamo's count of graphs compiled so far."""
    from torch._dynamo.utils import compile_times, counters

    names, values = compile_times(repr="csv", aggregate=True)
    seconds = dict(zip(names, map(float, values), strict=True))
    out = {k: seconds.get(timer, 0.0) for k, timer in _TIMERS.items()}
    out["graphs"] = float(counters["stats"]["unique_graphs"])
    return out


def _compile_note(
    first_s: float, median_s: float, before: dict[str, float], after_two: dict[str, float]
) -> str:
    """A compiled engine's compile time, measured apart from its steps, and recompiles."""
    end = _compile_counters()
    compile_s = first_s - median_s
    dynamo, inductor = (after_two[k] - before[k] for k in ("dynamo", "inductor"))
    return (
        f"compile {compile_s:.1f} s (the first step less a median one: Dynamo {dynamo:.1f} s, "
        f"inductor {inductor:.1f} s, AOTAutograd, passes and the rest "
        f"{compile_s - dynamo - inductor:.1f} s), "
        f"{int(after_two['graphs'] - before['graphs'])} graph(s) compiled in steps 1-2, "
        f"{int(end['graphs'] - after_two['graphs'])} recompile(s) after step 2 "
        "(torch._dynamo counters, rank 0)"
    )


def _measure(
    name: str,
    bm: BenchModel,
    settings: Settings,
    args: argparse.Namespace,
    data: tuple[torch.Tensor, torch.Tensor],
) -> Measured:
    """Build, wrap, warm up, time (and profile) one engine on this rank.

    Everything the engine allocates is local to this frame, so it is all released when
    the function returns or raises (see `_free`).
    """
    device = settings.device
    # A first, untimed set-up on a tiny model pays what any engine pays only once per
    # process (imports, DeepSpeed's accelerator and communication set-up, kernel caches),
    # so `init_s` is the cost of wrapping THIS model whichever engine runs first.
    with torch.device(device):
        throwaway = bm.tiny()
    ENGINES[name].setup(throwaway, settings)
    del throwaway
    _free(device)
    cuda = device.type == "cuda"
    before = torch.cuda.memory_allocated(device) if cuda else 0
    torch.manual_seed(0)
    # Built straight on the device, once, the same way for every engine: initializing on
    # the GPU takes seconds even at 7B (build_s says how many), and a fresh fp32 model is
    # what every engine's wrapping starts from.
    t0 = time.perf_counter()
    with torch.device(device):
        model = bm.build()
    _sync(device)
    build_s = time.perf_counter() - t0
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    t0 = time.perf_counter()
    step = ENGINES[name].setup(model, settings)
    _sync(device)
    init_s = time.perf_counter() - t0
    del model  # the engine holds what it needs
    compiled = name in COMPILED
    before = _compile_counters() if compiled else {}
    after_two = before
    times, first_s = [], 0.0
    for i in range(args.warmup + args.steps):
        t0 = time.perf_counter()
        step(*data)
        _sync(device)
        if i == 0:
            first_s = time.perf_counter() - t0
        if i == 1 and compiled:
            after_two = _compile_counters()
        if i >= args.warmup:
            times.append(time.perf_counter() - t0)
    if compiled and times and dist.get_rank() == 0:
        note = _compile_note(first_s, statistics.median(times), before, after_two)
        NOTES[name] = f"{NOTES[name]}; {note}" if name in NOTES else note
        print(f"[{name}] {note}", flush=True)
    # Between steps an engine keeps its model states (parameters, optimizer state, any
    # persistent gradient shards): what the 16 psi / N bound is about.
    states = (torch.cuda.memory_allocated(device) - before) / GIB if cuda else 0.0
    trace = profile(name, step, data, device, OUT / args.section) if args.profile else None
    peak = torch.cuda.max_memory_allocated(device) / GIB if cuda else 0.0
    return Measured(build_s, init_s, times, peak, states, trace)


def run_engine(
    name: str,
    bm: BenchModel,
    settings: Settings,
    args: argparse.Namespace,
    data: tuple[torch.Tensor, torch.Tensor],
) -> Result:
    """Build, wrap, warm up and time one engine; every rank calls this."""
    engine = ENGINES[name]
    world = dist.get_world_size()
    shard = settings.shard_group_size
    what = engine.what.format(shard=shard, replicate=max(world // shard, 1))
    rank = dist.get_rank()
    m = Measured(0.0, 0.0, [], 0.0, 0.0, None)
    error: str | None = None
    skipped: str | None = None
    dist.barrier()
    if rank == 0 or not engine.rank0_only:
        try:
            m = _measure(name, bm, settings, args, data)
        except Skipped as e:  # the same on every rank: the world decides it
            skipped = str(e)
        except Exception as e:  # OOM, import error, engine bug: a row, not the end
            error = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:160]
            if rank == 0:
                traceback.print_exc()
    _free(settings.device)  # after the except block, so the traceback's frames are gone
    if engine.rank0_only:
        dist.barrier()  # the others waited here while rank 0 ran alone
    if skipped:  # the hybrid's sizes do not apply: name the engine only
        return Result(name, engine.what.split(":")[0], skipped=skipped)
    median = statistics.median(m.times) if m.times else 0.0
    cuda = settings.device.type == "cuda"
    left = torch.cuda.memory_allocated(settings.device) / GIB if cuda else 0.0
    figures = [m.build_s, m.init_s, median, m.peak_gib, m.states_gib, left]
    values, error = _agree(figures, error is None, error)
    build_s, init_s, median, peak, states, left = values
    if error:
        return Result(name, what, error=error, left_gib=left)
    return Result(
        name,
        what,
        init_s,
        median * 1000,
        peak or None,
        None,
        m.trace,
        left,
        build_s=build_s,
        states_gib=states or None,
    )


def save_json(
    results: list[Result], bm: BenchModel, args: argparse.Namespace, settings: Settings, world: int
) -> Path:
    """bench-out/<section>.json: every row plus what it was measured on and with."""
    cuda = settings.device.type == "cuda"
    tokens = args.micro_batch * bm.seq_len
    meta = {
        "section": args.section,
        "model_name": bm.name,
        "preset": bm.preset,
        "model": bm.config,
        "parameters": bm.parameters,
        "flops_per_token": bm.flops_per_token,
        "world": world,
        "micro_batch": args.micro_batch,
        "seq_len": bm.seq_len,
        "tokens_per_step_per_gpu": tokens,
        "dtype": str(settings.dtype).removeprefix("torch."),
        "activation_checkpointing": args.activation_checkpointing,
        "shard_group_size": settings.shard_group_size,
        "clip": args.clip,
        "warmup": args.warmup,
        "steps": args.steps,
        "zs_config": settings.zs_config,
        "device": torch.cuda.get_device_name(settings.device) if cuda else "cpu",
        "torch": torch.__version__,
        "cuda": torch.version.cuda if cuda else None,
        "date": datetime.date.today().isoformat(),
        "command": command(),
    }
    rows = []
    for r in results:
        row = asdict(r)
        row["tokens_per_s_per_gpu"] = tokens / (r.step_ms / 1000) if r.step_ms else None
        rows.append(row)
    OUT.mkdir(exist_ok=True)
    path = OUT / f"{args.section}.json"
    path.write_text(json.dumps({"meta": meta, "results": rows}, indent=1))
    return path


def warm_up_process(device: torch.device) -> None:
    """Pay the one-time costs (optimizer and dynamo imports, CUDA/NCCL and kernel set-up)
    before any engine, so that the first engine's init time is not charged for them."""
    p = torch.nn.Parameter(torch.ones(64, 64, device=device))
    opt = torch.optim.AdamW([p], fused=device.type == "cuda")
    with torch.autocast(device.type, dtype=torch.bfloat16):
        loss: torch.Tensor = torch.mm(p, p).float().sum()
    torch.autograd.backward(loss)
    opt.step()
    t = torch.ones(1024, device=device)
    dist.all_reduce(t)
    dist.barrier()
    _sync(device)


def main() -> None:
    """Run every chosen engine in turn and write the report on rank 0."""
    args = parse_args()
    # DeepSpeed still calls the flat collectives by their pre-2.13 names: one warning each.
    warnings.filterwarnings("ignore", message=r".*torch\.distributed\.\w+` is deprecated")
    if "RANK" not in os.environ:  # plain `python train_step.py`: a world of one
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29517")
    use_cuda = torch.cuda.is_available() and not args.smoke
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if use_cuda:
        torch.cuda.set_device(local)
    dist.init_process_group("nccl" if use_cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local) if use_cuda else torch.device("cpu")
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
    )
    names = (
        args.engines.split(",")
        if args.engines
        else [n for n, e in ENGINES.items() if e.available()]
    )
    # DeepSpeed last (a stable sort keeps the order otherwise): see the note on ENGINES.
    names.sort(key=lambda n: n.startswith("ds"))
    g = torch.Generator().manual_seed(1234)
    tokens = torch.randint(0, bm.vocab_size, (args.micro_batch, bm.seq_len + 1), generator=g)
    data = (tokens[:, :-1].to(device), tokens[:, 1:].to(device))

    warm_up_process(device)
    results = []
    for name in names:
        t0 = time.perf_counter()
        r = run_engine(name, bm, settings, args, data)
        results.append(r)
        if rank == 0:
            # Saved after every engine: a run cut short by a time limit keeps what it measured.
            save_json(results, bm, args, settings, world)
            state = (
                r.error
                or (r.skipped and f"skipped: {r.skipped}")
                or (
                    f"{r.step_ms:.1f} ms/step, init {r.init_s:.2f} s, build {r.build_s:.1f} s, "
                    f"peak {r.peak_gib or 0:.1f} GiB, states {r.states_gib or 0:.1f} GiB"
                )
            )
            state += f", {r.left_gib:.2f} GiB left allocated" if r.left_gib else ""
            print(f"[train_step] {name}: {state} ({time.perf_counter() - t0:.0f} s)", flush=True)

    if rank == 0:
        body = report(results, bm, args, settings, world)
        if NOTES:
            body += "\n\n" + "\n".join(f"- `{name}`: {note}." for name, note in NOTES.items())
        print(body)
        title = f"{bm.name} {bm.preset}: {args.section}"
        if args.smoke or args.no_write:
            plot(results, OUT / f"{args.section}.png", title)
            plot_split(results, OUT / f"{args.section}_split.png", title)
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
            title = f"Training step ({bm.name}): zeroshard vs DDP, FSDP2, DeepSpeed"
            if args.section != "train_step":
                title += f" ({args.section})"
            write_section(args.section, title, body)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
