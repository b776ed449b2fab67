"""The `zeroshard-ckpt` command: `consolidate SRC OUT`, `convert SRC DST`, `to-dcp SRC DST`
and `inspect SRC`."""

from __future__ import annotations

import argparse
import importlib.metadata
import sys
from collections.abc import Sequence

from zeroshard.ckpt._consolidate import DTYPES, consolidate
from zeroshard.ckpt._errors import CheckpointError
from zeroshard.ckpt._inspect import describe, format_summary
from zeroshard.ckpt._plan import INDEX_FILE, parse_size
from zeroshard.ckpt._writer import default_workers
from zeroshard.ckpt.foreign import DCP_LAYOUTS, convert_deepspeed, convert_to_dcp

DEFAULT_MAX_SHARD = "5GB"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="zeroshard-ckpt",
        description="Inspect, consolidate and convert zeroshard, DeepSpeed ZeRO and PyTorch "
        "DCP checkpoints.",
    )
    p.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    sub = p.add_subparsers(dest="command", required=True)
    c = sub.add_parser(
        "consolidate",
        help="write the full state dict as safetensors",
        description="Write a checkpoint's full state dict (original names, tied parameters "
        "once, buffers included) as safetensors: OUT ending in .safetensors is one file, "
        "otherwise a directory with model.safetensors or Hugging Face shards and an index.",
    )
    c.add_argument("src", help="checkpoint directory or root (zeroshard or DeepSpeed)")
    c.add_argument("out", help="output directory, or a .safetensors file")
    c.add_argument(
        "--dtype",
        choices=sorted(DTYPES),
        default="fp32",
        help="dtype of every floating tensor, as zero_to_fp32 writes them (default: fp32)",
    )
    c.add_argument(
        "--max-shard-size",
        help="largest output file, e.g. 5GB, 500MB, 2GiB "
        f"(directory output; default {DEFAULT_MAX_SHARD})",
    )
    c.add_argument("--workers", type=int, help=f"threads (default: all cores, {default_workers()})")
    c.add_argument(
        "--max-buffer-memory",
        help="host memory for tensor data, all workers together, e.g. 512MiB (default 1GiB)",
    )
    c.add_argument("--low-memory", action="store_true", help="32 MiB of buffers in 8 MiB chunks")
    c.add_argument("--exclude-frozen", action="store_true", help="leave frozen parameters out")
    c.add_argument("--overwrite", action="store_true", help="replace OUT if it exists")
    c.add_argument(
        "--instance",
        type=int,
        help="which instance of parameters on their own process group (experts) to write",
    )
    c.add_argument(
        "--verify", action="store_true", help="re-read the output and compare it with the source"
    )
    _add_selector(c)
    c.add_argument("--quiet", action="store_true", help="no progress bar or summary")
    v = sub.add_parser(
        "convert",
        help="write a DeepSpeed ZeRO checkpoint as a zeroshard checkpoint",
        description="Rewrite a DeepSpeed ZeRO 1/2/3 checkpoint (weights, Adam state, loss "
        "scale, step) as a zeroshard checkpoint DST/step-N, so that load_checkpoint resumes "
        "from it at any world size without DeepSpeed.",
    )
    v.add_argument("src", help="DeepSpeed checkpoint directory (with 'latest') or tag folder")
    v.add_argument("dst", help="zeroshard checkpoint root to write into")
    v.add_argument("--tag", help="DeepSpeed tag under SRC (default: the 'latest' pointer)")
    v.add_argument("--world-size", type=int, help="rank files to write (default: DeepSpeed's)")
    v.add_argument("--workers", type=int, help=f"threads (default: all cores, {default_workers()})")
    v.add_argument("--overwrite", action="store_true", help="replace DST/step-N if it exists")
    d = sub.add_parser(
        "to-dcp",
        help="write a zeroshard checkpoint as a PyTorch DCP checkpoint for FSDP2",
        description="Rewrite a zeroshard checkpoint (weights, buffers, Adam state, "
        "hyperparameters, step) as a PyTorch DCP checkpoint directory DST laid out as "
        "FSDP2's get_state_dict saves it ('model', 'optimizer', 'step'): an FSDP2 job at any "
        "world size loads it with dcp.load and set_state_dict (docs/coming-from.md).",
    )
    d.add_argument("src", help="zeroshard checkpoint directory or root")
    d.add_argument("dst", help="DCP checkpoint directory to write")
    _add_selector(d)
    d.add_argument(
        "--layout",
        choices=DCP_LAYOUTS,
        default="fsdp2",
        help="fsdp2: 'model', 'optimizer', 'step' (default); torchtitan: the model at the top "
        "level, the optimizer flattened, 'train_state'",
    )
    d.add_argument("--workers", type=int, help=f"threads (default: all cores, {default_workers()})")
    d.add_argument("--overwrite", action="store_true", help="replace DST if it exists")
    i = sub.add_parser("inspect", help="print what a checkpoint holds")
    i.add_argument("src", help="checkpoint directory or root (zeroshard or DeepSpeed)")
    _add_selector(i)
    return p


def _version() -> str:
    # The installed distribution's version: the one place it is written is pyproject.toml.
    try:
        return importlib.metadata.version("zeroshard-ckpt")
    except importlib.metadata.PackageNotFoundError:
        return "(not installed: run from a source tree)"


def _add_selector(p: argparse.ArgumentParser) -> None:
    g = p.add_mutually_exclusive_group()
    g.add_argument("--tag", help="checkpoint tag under SRC (default: the 'latest' pointer)")
    g.add_argument("--step", type=int, help="checkpoint step under SRC")


def _consolidate(a: argparse.Namespace) -> int:
    single = a.out.endswith(".safetensors")
    if single and a.max_shard_size is not None:
        raise CheckpointError("--max-shard-size needs a directory OUT, not a .safetensors file")
    size = None if single else parse_size(a.max_shard_size or DEFAULT_MAX_SHARD)
    if a.workers is not None and a.workers < 1:
        raise CheckpointError(f"--workers must be >= 1, got {a.workers}")
    r = consolidate(
        a.src,
        a.out,
        dtype=DTYPES[a.dtype],
        max_shard_size=size,
        workers=a.workers,
        low_memory=a.low_memory,
        max_buffer_bytes=parse_size(a.max_buffer_memory) if a.max_buffer_memory else None,
        exclude_frozen=a.exclude_frozen,
        tag=a.tag,
        step=a.step,
        overwrite=a.overwrite,
        verify=a.verify,
        progress=not a.quiet and sys.stderr.isatty(),
        instance=a.instance,
    )
    if not a.quiet:
        rate = r.bytes / max(r.seconds, 1e-9) / 1e9
        checked = ", verified" if r.verified else ""
        # `files` ends with the index when there is one: it holds no tensors.
        weights = [f for f in r.files if f.name != INDEX_FILE]
        index = " and an index" if len(weights) < len(r.files) else ""
        print(
            f"wrote {r.tensors} tensors, {r.bytes / 1e9:.3f} GB in {len(weights)} safetensors "
            f"file(s){index} to "
            f"{r.path} in {r.seconds:.2f} s ({rate:.2f} GB/s{checked}; "
            f"buffers peaked at {r.peak_buffer_bytes / 2**20:.1f} MiB)"
        )
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; return the exit status (errors print one line, status 1)."""
    a = _parser().parse_args(argv)
    try:
        if a.command == "consolidate":
            return _consolidate(a)
        if a.command == "convert":
            out = convert_deepspeed(
                a.src,
                a.dst,
                tag=a.tag,
                world_size=a.world_size,
                workers=a.workers,
                overwrite=a.overwrite,
            )
            print(f"wrote {out}")
            return 0
        if a.command == "to-dcp":
            out = convert_to_dcp(
                a.src,
                a.dst,
                tag=a.tag,
                step=a.step,
                layout=a.layout,
                workers=a.workers,
                overwrite=a.overwrite,
            )
            print(f"wrote {out}")
            return 0
        print(format_summary(describe(a.src, tag=a.tag, step=a.step)))
        return 0
    except (CheckpointError, ValueError, OSError) as e:
        print(f"zeroshard-ckpt: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
