"""Consolidating a sharded checkpoint: zeroshard vs the framework's own tool.

    PYTHONPATH=.site python -m benchmarks.consolidate         # DeepSpeed ZeRO-3, 1.31 B GPT
    python -m benchmarks.consolidate --source dcp             # FSDP2's DCP, 1.31 B GPT
    python -m benchmarks.consolidate --smoke [--source dcp]   # small GPT, 2 CPU ranks (gloo)

`--source deepspeed` needs DeepSpeed (`DS_BUILD_OPS=0 pip install deepspeed==0.19.8`, plus
huggingface_hub, which zero_to_fp32 needs for its default sharding). In one run:

1. The framework itself makes the checkpoint of a GPT-2-style model (d 2048, 24 layers,
   vocab 50304, embedding tied to the head: 1.31 B parameters) on `--world` ranks (GPUs
   over NCCL where there is one per rank, else CPU ranks over gloo, the cores shared
   between them: see benchmarks/_common/_ranks.py). DeepSpeed: built
   under `deepspeed.zero.Init`, one AdamW step with ZeRO-3 in bf16, `save_checkpoint`.
   DCP: FSDP2 `fully_shard` per block and at the root in fp32, `dcp.save`. `--smoke`:
   d 256, 4 layers, vocab 4096. `--ckpt` keeps the checkpoint, or reuses one.
2. The disk floor, measured in the same run: `dd` writes as many bytes as the output
   (conv=fdatasync), then reads back as many bytes as consolidation must read (DeepSpeed:
   the fp32 master partitions, frozen parameters and buffers) after evicting them from the
   page cache (cold floor = write + cold read), and once more from the cache (warm floor).
3. Each tool runs as a subprocess, `--repeats` times (>= 3) cold and as many warm, the
   order of the tools alternating from round to round: the peer (zero_to_fp32
   `--safe_serialization`, or its pickle .bin where that fails, as it does on tied
   weights; torch's `dcp_to_torch_save`, one pickle file) and `zeroshard-ckpt
   consolidate`. Cold: every input and output file is fsynced and evicted from the page
   cache (`posix_fadvise(DONTNEED)`, no root needed) before each run; warm: the input was
   just read. Time = the subprocess's wall time plus fsync of what it wrote (the peers do
   not sync, we do; both pay the same); median and spread (min-max) of the runs; peak
   RSS = the subprocess's ru_maxrss (os.wait4); disk read = its ru_inblock (cold runs:
   what it really read from disk).
4. Both outputs are compared tensor by tensor (bit for bit, tied names included).

Full runs write the source's section of docs/benchmarks.md ("consolidate",
"consolidate_dcp") on any host: consolidation is a disk and CPU benchmark, and the
section's first line names the host and where the ranks ran; `--smoke` writes bench-out/.
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import sys
import tempfile
from pathlib import Path

from benchmarks._common import ROOT, SMOKE_OUT, Placement, place_ranks, publish, spawn_ranks
from benchmarks.consolidate._dcp import DCP
from benchmarks.consolidate._deepspeed import DEEPSPEED
from benchmarks.consolidate._floor import disk_floor
from benchmarks.consolidate._measure import measure_tools
from benchmarks.consolidate._report import report
from benchmarks.consolidate._source import Source
from benchmarks.consolidate._tools import files

SOURCES = {s.name: s for s in (DEEPSPEED, DCP)}
# The measured tools import zeroshard from this tree, whatever is installed.
SRC_PATHS = [str(ROOT / "packages" / p / "src") for p in ("comm", "partition", "ckpt")]


def parse_args() -> argparse.Namespace:
    """Command-line options."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--source", default="deepspeed", choices=list(SOURCES))
    p.add_argument("--smoke", action="store_true", help="small GPT on CPU ranks, bench-out only")
    p.add_argument("--d-model", type=int, default=2048)
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--vocab", type=int, default=50304)
    p.add_argument("--untied", action="store_true", help="do not tie the head to the embedding")
    p.add_argument("--world", type=int, default=2, help="ranks that make the checkpoint")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per tool and mode (>= 3)")
    p.add_argument("--workers", type=int, default=None, help="zeroshard --workers (default: all)")
    p.add_argument(
        "--dir",
        type=Path,
        default=SMOKE_OUT,
        help="where the work directory goes (default: bench-out/)",
    )
    p.add_argument("--keep", action="store_true", help="keep the work directory")
    p.add_argument(
        "--ckpt",
        type=Path,
        help="checkpoint to consolidate: made there (and kept) if it does not exist, "
        "reused if it does (the model options must match the run that made it)",
    )
    p.add_argument("--no-write", action="store_true", help="print the table, write nothing")
    args = p.parse_args()
    if args.repeats < 3:
        p.error("--repeats must be >= 3: the report gives medians and spreads")
    if args.smoke:
        args.d_model, args.layers, args.vocab = 256, 4, 4096
    return args


def tool_env() -> dict[str, str]:
    """The environment the measured tools run in: this tree's packages first on the path."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([*SRC_PATHS, env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return env


def measure(
    source: Source, args: argparse.Namespace, work: Path, placement: Placement | None
) -> str:
    """Make the checkpoint on `placement`'s ranks (None: reuse it), measure the disk floor
    and both tools; the report."""
    path = args.ckpt or work / "ckpt"
    made = math.nan if placement is None else spawn_ranks(source.make_rank, placement, (args, path))
    how = "reused" if placement is None else f"made in {made:.1f} s"
    print(f"{source.kind} {how}: {len(files(path))} files", flush=True)
    sys.path[:0] = SRC_PATHS
    ckpt = source.read(path)
    floor = disk_floor(work, ckpt.out_bytes, ckpt.read_bytes)
    print(f"floor: cold {floor.cold:.2f} s, warm {floor.warm:.2f} s", flush=True)
    m = measure_tools(source, path, work, tool_env(), args.repeats, args.workers)
    return report(source, args, ckpt, made, floor, m)


def main() -> None:
    """Make the checkpoint, measure the disk and both tools, report."""
    args = parse_args()
    source = SOURCES[args.source]
    # On the disk being measured (not /tmp, which may be memory), removed afterwards.
    args.dir.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f"zs-consolidate-{source.name}-", dir=args.dir))
    reuse = args.ckpt is not None and args.ckpt.exists()
    placement = None if reuse else place_ranks(args.world, smoke=args.smoke)
    if placement is not None:
        print(f"[consolidate] ranks making the checkpoint: {placement.describe()}", flush=True)
    try:
        body = measure(source, args, work, placement)
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    print(body, flush=True)
    if not args.no_write:
        # A disk and CPU benchmark: a full run on any host is a result (the environment
        # line names the host and where the ranks ran).
        ranks = None if placement is None else placement.describe()
        publish(source.section, source.title, body, smoke=args.smoke, ranks=ranks)


if __name__ == "__main__":
    main()
