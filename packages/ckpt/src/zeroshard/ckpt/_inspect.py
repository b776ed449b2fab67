"""`inspect`: what a checkpoint holds, as a small table (zeroshard, DeepSpeed or DCP)."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path

from zeroshard.ckpt._consolidate import deepspeed_checkpoint
from zeroshard.ckpt._errors import CheckpointError
from zeroshard.ckpt._meta import FORMAT_NAME
from zeroshard.ckpt._paths import is_zeroshard_checkpoint
from zeroshard.ckpt._reader import CheckpointReader
from zeroshard.ckpt.foreign import DCP_METADATA, dcp_specs, has_dcp_metadata
from zeroshard.partition import dtype_name


@dataclass(frozen=True)
class GroupSummary:
    """One flat group of a zeroshard checkpoint."""

    name: str
    tensors: int
    params: int
    dtype: str
    kinds: tuple[str, ...]
    frozen: bool


@dataclass(frozen=True)
class Summary:
    """What `zeroshard-ckpt inspect` prints; None where the format does not say."""

    path: Path
    format: str
    world_size: int | None
    stage: int | None
    step: int | None
    params: int
    tensors: int
    bytes: int
    files: int
    frozen: int
    tied: int
    buffers: int
    groups: tuple[GroupSummary, ...] = ()
    optimizers: tuple[str, ...] = ()
    """The class of the optimizer stepping each param group (zeroshard format 6)."""


def describe(
    src: str | os.PathLike[str], *, tag: str | None = None, step: int | None = None
) -> Summary:
    """Summarize a checkpoint without reading its tensor data (headers and metadata only)."""
    src = Path(src)
    if not src.exists():
        raise CheckpointError(f"{src} does not exist")
    if is_zeroshard_checkpoint(src, tag, step):
        with CheckpointReader(src, tag=tag, step=step) as r:
            m = r.meta
            groups = tuple(
                GroupSummary(
                    g.name,
                    len(g.layout.slots),
                    sum(math.prod(g.full_shape(s)) for s in g.layout.slots),
                    dtype_name(g.shards[g.value_kind]),
                    tuple(g.shards),
                    not g.requires_grad,
                )
                for g in m.groups
            )
            return Summary(
                r.path,
                f"{FORMAT_NAME} v{m.version}",
                m.world_size,
                m.stage,
                m.step,
                m.num_params,
                len(m.param_names),
                sum(f.size for f in m.files.values()),
                len(m.files),
                len(m.frozen),
                len(m.tied),
                len(m.buffers),
                groups,
                m.optimizers,
            )
    if has_dcp_metadata(src):
        return _describe_dcp(src)
    ds = deepspeed_checkpoint(src, tag=tag, step=step, exclude_frozen=False)
    files = [p for p in src.rglob("*.pt") if p.is_file()]
    params = [s for s in ds.specs if s.name not in ds.buffers]
    return Summary(
        src,
        "deepspeed" + (f" {ds.ds_version}" if ds.ds_version else ""),
        ds.world_size,
        ds.stage,
        ds.step if ds.step is not None else step,
        sum(s.numel for s in params),
        len(params),
        sum(p.stat().st_size for p in files),
        len(files),
        len(ds.frozen),
        len(ds.aliases),
        len(ds.buffers),
    )


def _describe_dcp(src: Path) -> Summary:
    # DCP records neither the world size nor which tensors are buffers, frozen or tied:
    # every model tensor counts as a parameter here.
    specs = dcp_specs(src)
    files = [p for p in src.iterdir() if p.is_file() and p.suffix == ".distcp"]
    files.append(src / DCP_METADATA)
    return Summary(
        src,
        "pytorch dcp (model tensors, buffers included)",
        None,
        None,
        None,
        sum(s.numel for s in specs),
        len(specs),
        sum(p.stat().st_size for p in files),
        len(files),
        0,
        0,
        0,
    )


def _human(n: int) -> str:
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            return f"{size:.1f} {unit}" if unit != "B" else f"{n} B"
        size /= 1024
    raise AssertionError("unreachable")


def format_summary(s: Summary) -> str:
    """The table `inspect` prints."""

    def opt(v: object) -> str:
        return "?" if v is None else str(v)

    rows = [
        ("path", str(s.path)),
        ("format", s.format),
        ("world size", opt(s.world_size)),
        ("stage", opt(s.stage)),
        ("step", opt(s.step)),
        ("parameters", f"{s.params:,} in {s.tensors} tensors"),
        ("frozen / tied / buffers", f"{s.frozen} / {s.tied} / {s.buffers}"),
        ("bytes", f"{_human(s.bytes)} in {s.files} files"),
    ]
    if s.optimizers:
        steps = ", ".join(f"{k}: {o}" for k, o in enumerate(s.optimizers))
        rows.append(("optimizers (param group)", steps))
    width = max(len(k) for k, _ in rows)
    lines = [f"{k:<{width}}  {v}" for k, v in rows]
    if s.groups:
        head = ("group", "tensors", "params", "dtype", "frozen", "shards")
        body = [
            (
                g.name,
                str(g.tensors),
                f"{g.params:,}",
                g.dtype,
                "yes" if g.frozen else "no",
                ", ".join(g.kinds),
            )
            for g in s.groups
        ]
        widths = [max(len(r[i]) for r in (head, *body)) for i in range(len(head))]
        lines.append("")
        for r in (head, *body):
            lines.append("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip())
    return "\n".join(lines)
