"""Consolidating a DeepSpeed ZeRO-3 checkpoint: zeroshard vs DeepSpeed's zero_to_fp32.

    PYTHONPATH=.site python -m benchmarks.consolidate          # 1.31 B GPT, 2 GPUs (NCCL)
    python -m benchmarks.consolidate --smoke                   # small GPT, 2 CPU ranks (gloo)

Needs DeepSpeed (`DS_BUILD_OPS=0 pip install deepspeed==0.19.8`, plus huggingface_hub,
which zero_to_fp32 needs for its default sharding). In one run:

1. DeepSpeed itself makes the checkpoint: a GPT-2-style model (d 2048, 24 layers,
   vocab 50304, embedding tied to the head: 1.31 B parameters) built under
   `deepspeed.zero.Init`, one AdamW step with ZeRO-3 in bf16 on 2 ranks (GPUs over NCCL
   where there are two, else CPU ranks over gloo), `save_checkpoint`. `--smoke`: d 256,
   4 layers, vocab 4096.
2. The disk floor, measured in the same run: `dd` writes as many bytes as the output
   (conv=fdatasync), then reads back as many bytes as consolidation must read (the fp32
   master partitions, frozen parameters and buffers) after evicting them from the page
   cache (cold floor = write + cold read), and once more from the cache (warm floor).
3. Each tool runs as a subprocess, `--repeats` times (>= 3) cold and as many warm, the
   order of the tools alternating from round to round: zero_to_fp32
   (`--safe_serialization`; if that fails, as it does on tied weights, its default
   pickle .bin output) and `zeroshard-ckpt consolidate`. Cold: every input and output
   file is fsynced and evicted from the page cache (`posix_fadvise(DONTNEED)`, no root
   needed) before each run; warm: the input was just read. Time = the subprocess's wall
   time plus fsync of what it wrote (zero_to_fp32 does not sync, we do; both pay the
   same); median and spread (min-max) of the runs; peak RSS = the subprocess's ru_maxrss
   (os.wait4); disk read = its ru_inblock (cold runs: what it really read from disk).
4. Both outputs are compared tensor by tensor (bit for bit, tied names included).

Full runs on a GPU host write the "consolidate" section of docs/benchmarks.md; `--smoke`
and runs on CPU-only machines write bench-out/consolidate.md only.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from benchmarks._report import markdown_table, write_section

ROOT = Path(__file__).resolve().parent.parent

OUT = ROOT / "bench-out"
GIB = 1024**3
SRC_PATHS = [str(ROOT / "packages" / p / "src") for p in ("comm", "partition", "ckpt")]


def parse_args() -> argparse.Namespace:
    """Command-line options."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true", help="small GPT on CPU ranks, bench-out only")
    p.add_argument("--d-model", type=int, default=2048)
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--vocab", type=int, default=50304)
    p.add_argument("--untied", action="store_true", help="do not tie the head to the embedding")
    p.add_argument("--world", type=int, default=2, help="ranks that make the checkpoint")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per tool and mode (>= 3)")
    p.add_argument("--workers", type=int, default=None, help="zeroshard --workers (default: all)")
    p.add_argument(
        "--dir", type=Path, default=OUT, help="where the work directory goes (default: bench-out/)"
    )
    p.add_argument("--keep", action="store_true", help="keep the work directory")
    p.add_argument(
        "--ckpt",
        type=Path,
        help="DeepSpeed checkpoint to consolidate: made there (and kept) if it does not exist, "
        "reused if it does (the model options must match the run that made it)",
    )
    p.add_argument("--no-write", action="store_true", help="print the table, write nothing")
    args = p.parse_args()
    if args.repeats < 3:
        p.error("--repeats must be >= 3: the report gives medians and spreads")
    if args.smoke:
        args.d_model, args.layers, args.vocab = 256, 4, 4096
    return args


# --- the model and the checkpoint DeepSpeed makes -------------------------------------


class Block(nn.Module):
    """A pre-norm GPT-2 block."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc, self.out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)
        self.heads = max(1, d // 128)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, -1).unbind(2)
        a = nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.out(nn.functional.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    """GPT-2 style: token and position embeddings, blocks, final norm, (tied) head."""

    def __init__(self, vocab: int, d: int, layers: int, tied: bool, ctx: int = 1024) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, d), nn.Embedding(ctx, d)
        self.blocks = nn.ModuleList(Block(d) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        if tied:
            self.head.weight = self.wte.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.wte(tokens) + self.wpe(torch.arange(tokens.shape[1], device=tokens.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def _make_rank(rank: int, world: int, port: int, args: argparse.Namespace, out: str) -> None:
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    import deepspeed

    cuda = torch.cuda.device_count() >= world and not args.smoke
    if cuda:
        torch.cuda.set_device(rank)
    else:
        torch.set_num_threads(1)
    deepspeed.init_distributed(dist_backend="nccl" if cuda else "gloo")
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "zero_allow_untested_optimizer": True,
        "zero_optimization": {"stage": 3},
        "bf16": {"enabled": True},
        "steps_per_print": 10**9,
    }
    torch.manual_seed(0)
    with deepspeed.zero.Init(config_dict_or_path=config):
        model = GPT(args.vocab, args.d_model, args.layers, tied=not args.untied)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    tokens = torch.randint(0, args.vocab, (1, 16), device=engine.device)
    logits = engine(tokens)
    loss = nn.functional.cross_entropy(logits.float().flatten(0, 1), tokens.flatten())
    engine.backward(loss)
    engine.step()
    engine.save_checkpoint(out, tag="global_step1")
    torch.distributed.barrier()


def spawn_ranks(make_rank: Callable[..., None], args: argparse.Namespace, out: Path) -> float:
    """Run `make_rank(rank, world, port, args, out)` on `args.world` spawned ranks; seconds."""
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    start = time.perf_counter()
    mp.start_processes(
        make_rank, args=(args.world, port, args, str(out)), nprocs=args.world, start_method="spawn"
    )
    return time.perf_counter() - start


def make_checkpoint(args: argparse.Namespace, out: Path) -> float:
    """Have DeepSpeed train one step and save a ZeRO-3 checkpoint; return seconds taken."""
    return spawn_ranks(_make_rank, args, out)


# --- measuring -------------------------------------------------------------------------


@dataclass(frozen=True)
class Run:
    """One subprocess run: exit status, wall seconds (with fsync), peak RSS, output."""

    rc: int
    seconds: float
    sync_seconds: float
    peak_rss: int
    read_bytes: int
    out_bytes: int
    log: str


def _files(path: Path) -> list[Path]:
    return [p for p in path.rglob("*") if p.is_file()] if path.exists() else []


def _sync(paths: list[Path]) -> None:
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _evict(paths: list[Path]) -> None:
    # Clean pages only: sync first so nothing dirty stays behind.
    _sync(paths)
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def run_tool(cmd: list[str], out: Path, env: dict[str, str]) -> Run:
    """Run `cmd`, fsync what it wrote under `out`; time, peak RSS (KiB -> bytes), size."""
    log = out.parent / f"{out.name}.log"
    start = time.perf_counter()
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env)
        _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    ran = time.perf_counter() - start
    files = _files(out)
    sync_start = time.perf_counter()
    _sync(files)
    synced = time.perf_counter() - sync_start
    return Run(
        rc=proc.returncode,
        seconds=ran + synced,
        sync_seconds=synced,
        peak_rss=usage.ru_maxrss * 1024,
        read_bytes=usage.ru_inblock * 512,
        out_bytes=sum(p.stat().st_size for p in files),
        log=log.read_text(errors="replace"),
    )


def _failure(run: Run) -> str:
    """The telling line of a failed run's log (the error, not the traceback's last hint)."""
    lines = [ln.strip() for ln in run.log.splitlines() if ln.strip()]
    for key in ("share memory", "Error:"):
        hits = [ln for ln in lines if key in ln]
        if hits:
            return hits[-1][:200]
    return lines[-1][:200] if lines else f"exit status {run.rc}"


@dataclass(frozen=True)
class Floor:
    """The disk floor of one consolidation, measured with dd in this run (seconds)."""

    write: float  # the output's bytes, written and fdatasynced
    cold_read: float  # the bytes consolidation must read, from the disk
    warm_read: float  # the same bytes, from the page cache

    @property
    def cold(self) -> float:
        """Cold floor: read what must be read from the disk, write the output."""
        return self.cold_read + self.write

    @property
    def warm(self) -> float:
        """Warm floor: read what must be read from the page cache, write the output."""
        return self.warm_read + self.write


def _dd(args: list[str]) -> float:
    start = time.perf_counter()
    subprocess.run(["dd", *args, "bs=4M"], check=True, capture_output=True)
    return time.perf_counter() - start


def disk_floor(work: Path, out_bytes: int, read_bytes: int) -> Floor:
    """dd: write `out_bytes` (fdatasync), then read `read_bytes` of it cold, then warm."""
    path = work / "dd.bin"
    blocks = max(1, math.ceil(max(out_bytes, read_bytes) / (4 << 20)))
    write = _dd(["if=/dev/zero", f"of={path}", f"count={blocks}", "conv=fdatasync"])
    write *= out_bytes / (blocks * (4 << 20))
    reading = [f"if={path}", "of=/dev/null", f"count={max(1, math.ceil(read_bytes / (4 << 20)))}"]
    _evict([path])
    cold = _dd(reading)
    warm = _dd(reading)
    path.unlink()
    return Floor(write, cold, warm)


def compare_outputs(ours: Path, theirs: Path) -> tuple[int, str]:
    """Compare our safetensors output with zero_to_fp32's, tensor by tensor; (count, problem)."""
    from safetensors import safe_open

    mine: dict[str, torch.Tensor] = {}
    tied: dict[str, str] = {}
    handles = []
    for f in sorted(ours.glob("*.safetensors")):
        h = safe_open(str(f), framework="pt")
        handles.append(h)
        tied.update(json.loads((h.metadata() or {}).get("zeroshard.tied", "{}")))
        for k in h.keys():  # noqa: SIM118 (safe_open is not a mapping)
            mine[k] = h.get_tensor(k)
    checked = 0
    for f in sorted(theirs.iterdir()):
        if f.suffix == ".bin":
            part = torch.load(f, map_location="cpu", mmap=True, weights_only=True)
        elif f.suffix == ".safetensors":
            h = safe_open(str(f), framework="pt")
            part = {k: h.get_tensor(k) for k in h.keys()}  # noqa: SIM118
        else:
            continue
        for name, want in part.items():
            got = mine.get(tied.get(name, name))
            if got is None:
                return checked, f"{name} missing from zeroshard's output"
            if got.dtype != want.dtype or got.shape != want.shape or not torch.equal(got, want):
                return checked, f"{name} differs"
            checked += 1
    expected = len(mine) + len(tied)
    if checked != expected:
        return checked, f"zero_to_fp32 wrote {checked} tensors, zeroshard {expected} (with tied)"
    return checked, ""


# --- the run ---------------------------------------------------------------------------


def tool_env() -> dict[str, str]:
    """The environment the measured tools run in: this tree's packages first on the path."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([*SRC_PATHS, env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return env


def main() -> None:
    """Make the checkpoint, measure the disk and both tools, report."""
    args = parse_args()
    # On the disk being measured (not /tmp, which may be memory), removed afterwards.
    args.dir.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="zs-consolidate-", dir=args.dir))
    env = tool_env()
    try:
        body = measure(args, work, env)
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    print(body, flush=True)
    if args.no_write:
        return
    if args.smoke or torch.cuda.device_count() < args.world:
        # Figures for docs/benchmarks.md come from the GPU host only.
        OUT.mkdir(exist_ok=True)
        (OUT / "consolidate.md").write_text(body + "\n")
    else:
        write_section("consolidate", "Consolidating a DeepSpeed ZeRO-3 checkpoint", body)


def _read_all(paths: list[Path]) -> None:
    """Read every file once, so that the warm runs find the input in the page cache."""
    for p in paths:
        with open(p, "rb", buffering=0) as f:
            while f.read(16 << 20):
                pass


def measure(args: argparse.Namespace, work: Path, env: dict[str, str]) -> str:
    """Everything but the writing of the report; returns the report's markdown."""
    ckpt = args.ckpt or work / "ckpt"
    made = math.nan if ckpt.exists() else make_checkpoint(args, ckpt)
    inputs = _files(ckpt)
    optim = [p for p in inputs if p.name.endswith("_optim_states.pt")]
    how = "reused" if math.isnan(made) else f"made in {made:.1f} s"
    print(f"DeepSpeed checkpoint {how}: {len(inputs)} files", flush=True)

    sys.path[:0] = SRC_PATHS
    from zeroshard.ckpt._deepspeed import read_deepspeed_checkpoint

    layout = read_deepspeed_checkpoint(ckpt)
    params = sum(s.numel for s in layout.specs)
    needed = sum(s.numel * s.dtype.itemsize for s in layout.specs)  # what must be read
    # The output: every floating tensor in fp32 (both tools' default), others as stored.
    out_bytes = sum(
        s.numel * (4 if s.dtype.is_floating_point else s.dtype.itemsize) for s in layout.specs
    )
    floor = disk_floor(work, out_bytes, needed)
    print(f"floor: cold {floor.cold:.2f} s, warm {floor.warm:.2f} s", flush=True)

    py = sys.executable

    def zs_cmd(out: Path) -> list[str]:
        workers = ["--workers", str(args.workers)] if args.workers else []
        cli = [py, "-m", "zeroshard.ckpt._cli", "consolidate"]
        return [*cli, str(ckpt), str(out), "--quiet", *workers]

    def ds_cmd(out: Path, safe: bool) -> list[str]:
        safe_flag = ["--safe_serialization"] if safe else []
        return [py, "-m", "deepspeed.utils.zero_to_fp32", str(ckpt), str(out), *safe_flag]

    def prepare(mode: str) -> None:
        if mode == "cold":
            _evict(inputs)
        else:
            _read_all(inputs)

    ds_safe = True
    ds_failure = ""
    runs: dict[tuple[str, str], list[Run]] = {}
    last: dict[str, Path] = {}
    for mode in ("cold", "warm"):
        for i in range(args.repeats):
            # Alternate which tool goes first: neither always finds the other's leftovers.
            order = ("zero_to_fp32", "zeroshard") if i % 2 == 0 else ("zeroshard", "zero_to_fp32")
            for tool in order:
                out = work / f"{tool}-{mode}-{i}"
                if tool in last:
                    shutil.rmtree(last.pop(tool), ignore_errors=True)
                prepare(mode)
                run = run_tool(
                    zs_cmd(out) if tool == "zeroshard" else ds_cmd(out, ds_safe), out, env
                )
                if tool == "zero_to_fp32" and ds_safe and run.rc != 0:
                    # zero_to_fp32 --safe_serialization refuses tied weights: time its .bin.
                    ds_safe = False
                    ds_failure = _failure(run)
                    print(f"zero_to_fp32 --safe_serialization failed: {ds_failure}", flush=True)
                    shutil.rmtree(out, ignore_errors=True)
                    prepare(mode)
                    run = run_tool(ds_cmd(out, False), out, env)
                if run.rc != 0:
                    raise RuntimeError(f"{tool} failed ({run.rc}):\n{run.log[-3000:]}")
                runs.setdefault((tool, mode), []).append(run)
                print(
                    f"{tool} {mode} run {i}: {run.seconds:.2f} s (fsync {run.sync_seconds:.2f} s), "
                    f"peak RSS {run.peak_rss / GIB:.2f} GiB, read {run.read_bytes / 1e9:.2f} GB "
                    f"from disk, wrote {run.out_bytes / 1e9:.2f} GB",
                    flush=True,
                )
                last[tool] = out
                # The output is evicted too, so the next cold run starts from a clean cache.
                _evict(_files(out))
    checked, problem = compare_outputs(last["zeroshard"], last["zero_to_fp32"])
    if problem:
        raise RuntimeError(f"outputs differ after {checked} tensors: {problem}")
    return report(
        args, layout, params, optim, made, needed, floor, runs, ds_safe, ds_failure, checked
    )


def _stats(values: list[float]) -> tuple[float, float, float]:
    """Median, min and max."""
    return statistics.median(values), min(values), max(values)


def report(
    args: argparse.Namespace,
    layout: Any,
    params: int,
    optim: list[Path],
    made: float,
    needed: int,
    floor: Floor,
    runs: dict[tuple[str, str], list[Run]],
    ds_safe: bool,
    ds_failure: str,
    checked: int,
) -> str:
    """The markdown section: setup, disk floor, the table (cold and warm), the targets."""
    ds_label = "zero_to_fp32 --safe_serialization" if ds_safe else "zero_to_fp32 (.bin)"
    labels = {"zero_to_fp32": ds_label, "zeroshard": "zeroshard-ckpt consolidate"}
    floors = {"cold": floor.cold, "warm": floor.warm}
    median = {key: _stats([r.seconds for r in rs])[0] for key, rs in runs.items()}
    rows = []
    for mode in ("cold", "warm"):
        for tool in ("zero_to_fp32", "zeroshard"):
            rs = runs[(tool, mode)]
            mid, lo, hi = _stats([r.seconds for r in rs])
            rows.append(
                [
                    mode,
                    labels[tool],
                    f"{mid:.2f}",
                    f"{lo:.2f}-{hi:.2f}",
                    f"{statistics.median(r.sync_seconds for r in rs):.2f}",
                    f"{rs[0].out_bytes / mid / 1e9:.2f}",
                    f"{max(r.peak_rss for r in rs) / GIB:.2f}",
                    f"{statistics.median(r.read_bytes for r in rs) / 1e9:.2f}",
                    f"{median[('zero_to_fp32', mode)] / mid:.2f}x",
                    f"{mid / floors[mode]:.2f}x",
                ]
            )
    optim_gb = ", ".join(f"{p.stat().st_size / 1e9:.2f}" for p in sorted(optim))
    took = "" if math.isnan(made) else f" in {made:.0f} s"
    out_gb = runs[("zeroshard", "cold")][0].out_bytes / 1e9
    lines = [
        f"DeepSpeed ZeRO-3 checkpoint of a GPT (d {args.d_model}, {args.layers} layers, vocab "
        f"{args.vocab}, head {'untied' if args.untied else 'tied to the embedding'}): "
        f"{params / 1e9:.3f} B parameters, made by DeepSpeed on {layout.world_size} ranks"
        f"{took} (optimizer files of {optim_gb} GB). {os.cpu_count()} cores; zeroshard "
        f"workers: {args.workers or 'all'}.",
        "",
        f"Disk floor (dd, 4 MiB blocks, this run): writing the {out_gb:.2f} GB output with "
        f"fdatasync {floor.write:.2f} s; reading the {needed / 1e9:.2f} GB that must be read "
        f"{floor.cold_read:.2f} s cold, {floor.warm_read:.2f} s from the page cache. Floor: "
        f"cold {floor.cold:.2f} s, warm {floor.warm:.2f} s.",
        "",
        markdown_table(
            [
                "input",
                "tool",
                f"median s ({args.repeats} runs)",
                "spread s",
                "of which fsync s",
                "GB/s",
                "peak RSS GiB",
                "read from disk GB",
                "speed-up vs zero_to_fp32",
                "x floor",
            ],
            rows,
        ),
        "",
        "Cold: every input and output file fsynced and evicted from the page cache before "
        "each run; warm: the input read just before. The tools' order alternates by round.",
    ]
    if ds_failure:
        lines.append(f"`zero_to_fp32 --safe_serialization` failed: `{ds_failure}`; timed its .bin.")
    lines.append(
        "Times include fsync of the output: zeroshard syncs before it exits, zero_to_fp32 does "
        "not, so the benchmark syncs its files after it exits (that part is shown)."
    )
    lines.append(
        f"Outputs compared tensor by tensor: {checked} tensors bit-identical (tied names included)."
    )
    peak = max(r.peak_rss for r in runs[("zeroshard", "cold")] + runs[("zeroshard", "warm")]) / GIB
    goals = [
        f"{mode}: {median[('zero_to_fp32', mode)] / median[('zeroshard', mode)]:.2f}x "
        f"zero_to_fp32 (goal >= 3x), {median[('zeroshard', mode)] / floors[mode]:.2f}x the "
        "floor (goal <= 1.4x)"
        for mode in ("cold", "warm")
    ]
    lines.append(f"Goals: {'; '.join(goals)}; peak RSS {peak:.2f} GiB (goal <= 2 GiB).")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
