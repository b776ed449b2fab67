"""Consolidating a PyTorch DCP checkpoint written by FSDP2: zeroshard vs `dcp_to_torch_save`.

    python -m benchmarks.consolidate_dcp           # 1.31 B GPT, 2 GPUs (NCCL)
    python -m benchmarks.consolidate_dcp --smoke   # small GPT, 2 CPU ranks (gloo)

1. FSDP2 makes the checkpoint: the GPT of `consolidate.py` (fp32, head tied to the
   embedding), `fully_shard` per block and at the root, `dcp.save(model.state_dict())`.
2. The disk floor, measured in the same run as in `consolidate.py`.
3. Each tool runs as a subprocess, `--repeats` times cold and warm, the order alternating
   from round to round: torch's `dcp_to_torch_save` (one pickle file) and
   `zeroshard-ckpt consolidate` (safetensors). Time, peak RSS and disk reads as in
   `consolidate.py`; both outputs are compared tensor by tensor, bit for bit.

Runs on a GPU host write the "consolidate_dcp" section of docs/benchmarks.md; `--smoke`
and CPU-only runs write bench-out/consolidate_dcp.md only.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

import torch

from benchmarks._report import markdown_table, write_section
from benchmarks.consolidate import (
    GIB,
    GPT,
    OUT,
    SRC_PATHS,
    Run,
    _evict,
    _files,
    _read_all,
    _stats,
    compare_outputs,
    disk_floor,
    run_tool,
    spawn_ranks,
    tool_env,
)

TOOLS = ("dcp_to_torch_save", "zeroshard")


def parse_args() -> argparse.Namespace:
    """Command-line options."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true", help="small GPT on CPU ranks, bench-out only")
    p.add_argument("--d-model", type=int, default=2048)
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--vocab", type=int, default=50304)
    p.add_argument("--world", type=int, default=2, help="ranks that make the checkpoint")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per tool and mode (>= 3)")
    p.add_argument("--dir", type=Path, default=OUT, help="where the work directory goes")
    p.add_argument("--no-write", action="store_true", help="print the table, write nothing")
    args = p.parse_args()
    if args.repeats < 3:
        p.error("--repeats must be >= 3: the report gives medians and spreads")
    if args.smoke:
        args.d_model, args.layers, args.vocab = 256, 4, 4096
    return args


def _on_gpus(args: argparse.Namespace) -> bool:
    return torch.cuda.device_count() >= args.world and not args.smoke


def _make_rank(rank: int, world: int, port: int, args: argparse.Namespace, out: str) -> None:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    cuda = _on_gpus(args)
    if cuda:
        torch.cuda.set_device(rank)
    else:
        torch.set_num_threads(1)
    dist.init_process_group(
        "nccl" if cuda else "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
    )
    mesh = init_device_mesh("cuda" if cuda else "cpu", (world,))
    torch.manual_seed(0)
    model = GPT(args.vocab, args.d_model, args.layers, tied=True)
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)  # moves the shards to the mesh's device
    dcp.save(model.state_dict(), checkpoint_id=out)
    dist.destroy_process_group()


def make_checkpoint(args: argparse.Namespace, out: Path) -> float:
    """Have FSDP2 shard the GPT and `dcp.save` it; return seconds taken."""
    return spawn_ranks(_make_rank, args, out)


def measure(args: argparse.Namespace, work: Path, env: dict[str, str]) -> str:
    """Make the checkpoint, measure the floor and both tools; the report's markdown."""
    ckpt = work / "ckpt"
    made = make_checkpoint(args, ckpt)
    inputs = _files(ckpt)
    sys.path[:0] = SRC_PATHS
    from zeroshard.ckpt._dcp import dcp_specs

    specs = dcp_specs(ckpt)
    nbytes = sum(s.numel * s.dtype.itemsize for s in specs)  # fp32: read = written
    floor = disk_floor(work, nbytes, nbytes)
    py = sys.executable
    to_torch = (
        "import os, sys; from torch.distributed.checkpoint.format_utils import "
        "dcp_to_torch_save as f; os.makedirs(sys.argv[2]); "
        "f(sys.argv[1], os.path.join(sys.argv[2], 'model.bin'))"
    )

    def command(tool: str, out: Path) -> list[str]:
        if tool == "zeroshard":
            return [py, "-m", "zeroshard.ckpt._cli", "consolidate", str(ckpt), str(out), "--quiet"]
        return [py, "-c", to_torch, str(ckpt), str(out)]

    runs: dict[tuple[str, str], list[Run]] = {}
    last: dict[str, Path] = {}
    for mode in ("cold", "warm"):
        for i in range(args.repeats):
            for tool in TOOLS if i % 2 == 0 else TOOLS[::-1]:
                if tool in last:
                    shutil.rmtree(last.pop(tool), ignore_errors=True)
                if mode == "cold":
                    _evict(inputs)
                else:
                    _read_all(inputs)
                out = work / f"{tool}-{mode}-{i}"
                run = run_tool(command(tool, out), out, env)
                if run.rc != 0:
                    raise RuntimeError(f"{tool} failed ({run.rc}):\n{run.log[-3000:]}")
                runs.setdefault((tool, mode), []).append(run)
                print(f"{tool} {mode} run {i}: {run.seconds:.2f} s", flush=True)
                last[tool] = out
                _evict(_files(out))
    checked, problem = compare_outputs(last["zeroshard"], last["dcp_to_torch_save"])
    if problem:
        raise RuntimeError(f"outputs differ after {checked} tensors: {problem}")
    rows = []
    for mode in ("cold", "warm"):
        ref = statistics.median(r.seconds for r in runs[("dcp_to_torch_save", mode)])
        for tool in TOOLS:
            rs = runs[(tool, mode)]
            mid, lo, hi = _stats([r.seconds for r in rs])
            rows.append(
                [
                    mode,
                    tool,
                    f"{mid:.2f}",
                    f"{lo:.2f}-{hi:.2f}",
                    f"{max(r.peak_rss for r in rs) / GIB:.2f}",
                    f"{statistics.median(r.read_bytes for r in rs) / 1e9:.2f}",
                    f"{ref / mid:.2f}x",
                    f"{mid / (floor.cold if mode == 'cold' else floor.warm):.2f}x",
                ]
            )
    params = sum(s.numel for s in specs)
    head = ["input", "tool", f"median s ({args.repeats} runs)", "spread s", "peak RSS GiB"]
    head += ["read from disk GB", "speed-up vs dcp_to_torch_save", "x floor"]
    return "\n".join(
        [
            f"DCP checkpoint of a GPT (d {args.d_model}, {args.layers} layers, vocab "
            f"{args.vocab}, tied head): {params / 1e9:.3f} B parameters in fp32, written by "
            f"FSDP2 on {args.world} ranks in {made:.0f} s. {os.cpu_count()} cores.",
            "",
            f"Disk floor (dd, this run): cold {floor.cold:.2f} s, warm {floor.warm:.2f} s "
            f"(write {nbytes / 1e9:.2f} GB {floor.write:.2f} s, read it {floor.cold_read:.2f} s "
            f"cold, {floor.warm_read:.2f} s cached).",
            "",
            markdown_table(head, rows),
            "",
            "Cold: inputs and outputs fsynced and evicted from the page cache before each "
            "run; warm: the input read just before; the tools' order alternates by round. "
            f"Outputs compared: {checked} tensors bit-identical.",
        ]
    )


def main() -> None:
    """Run the benchmark and write its report."""
    args = parse_args()
    args.dir.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="zs-consolidate-dcp-", dir=args.dir))
    env = tool_env()
    try:
        body = measure(args, work, env)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(body, flush=True)
    if args.no_write:
        return
    if args.smoke or not _on_gpus(args):
        OUT.mkdir(exist_ok=True)
        (OUT / "consolidate_dcp.md").write_text(body + "\n")
    else:
        write_section("consolidate_dcp", "Consolidating an FSDP2 DCP checkpoint", body)


if __name__ == "__main__":
    main()
