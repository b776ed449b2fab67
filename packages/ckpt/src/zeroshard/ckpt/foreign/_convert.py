"""`convert_deepspeed`: a DeepSpeed ZeRO checkpoint rewritten as a zeroshard checkpoint.

The output holds one flat group per DeepSpeed param group (`ds_group{i}`: fp32 master,
`optim.exp_avg`, `optim.exp_avg_sq`, Adam's `step` as a scalar) and one for the frozen
parameters (`ds_frozen`), the buffers, tied names, hyperparameters and the fp16 loss
scale, with `extra["converted_from"]` naming the source. Its groups are not the ones an
engine builds, so `load_checkpoint` reads it by parameter name (`read_named_state`),
at any world size and stage. Rank files are written in parallel, streamed: each worker
reads only its element ranges from DeepSpeed's files, one chunk of `CHUNK_ELEMENTS` at
a time (16 MiB of fp32), and the files are committed like `save`'s: a temp directory
renamed into place, `latest` moved last.
"""

from __future__ import annotations

import math
import os
import shutil
import zlib
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, NamedTuple

import torch

from zeroshard.ckpt._errors import CheckpointError
from zeroshard.ckpt._group_meta import FileMeta, GroupMeta
from zeroshard.ckpt._keys import MASTER, OPTIM_PREFIX, buffer_key, rank_file, shard_key
from zeroshard.ckpt._meta import CheckpointMeta
from zeroshard.ckpt._paths import (
    check_output_apart,
    checkpoint_name,
    is_zeroshard_checkpoint,
    temp_dir,
)
from zeroshard.ckpt._save import _prepare, _publish
from zeroshard.ckpt._stfile import fsync_dir, plan_header, tensor_bytes
from zeroshard.ckpt._writer import RangeSpec, default_workers
from zeroshard.ckpt.foreign._deepspeed_optim import read_deepspeed_training_state
from zeroshard.ckpt.foreign._named_state import NamedTrainingState
from zeroshard.partition import FlatLayout

CONVERTED_FROM = "converted_from"
_FROZEN = "ds_frozen"


def _json(value: Any) -> Any:
    if isinstance(value, tuple):
        return [_json(v) for v in value]
    return value


def _groups(named: NamedTrainingState, world_size: int) -> list[tuple[GroupMeta, dict[str, Any]]]:
    """Each output group with kind -> {name: spec} to fill it from."""
    out: list[tuple[GroupMeta, dict[str, Any]]] = []
    trainable: set[str] = set()
    for i, pg in enumerate(named.param_groups):
        names = list(pg.names)
        trainable.update(pg.names)
        if not names:
            continue
        layout = FlatLayout.build(
            [(n, named.masters[n].shape) for n in names], torch.float32, world_size
        )
        sources: dict[str, Any] = {MASTER: named.masters}
        for key, specs in named.optimizer_state.items():
            sources[OPTIM_PREFIX + key] = specs
        kinds = dict.fromkeys(sources, torch.float32)
        gm = GroupMeta(f"ds_group{i}", layout, kinds, param_group=i, scalars=dict(pg.scalars))
        out.append((gm, sources))
    frozen = [n for n in named.masters if n not in trainable]
    if frozen:
        layout = FlatLayout.build(
            [(n, named.masters[n].shape) for n in frozen], torch.float32, world_size
        )
        gm = GroupMeta(
            _FROZEN, layout, {MASTER: torch.float32}, param_group=None, requires_grad=False
        )
        out.append((gm, {MASTER: named.masters}))
    return out


# Elements per write: each worker holds one chunk of one tensor, never a whole shard.
CHUNK_ELEMENTS = 4 * 2**20


class _Entry(NamedTuple):
    """One tensor of a rank file: `fill(start, out)` writes its elements [start, ...)."""

    key: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    fill: Callable[[int, torch.Tensor], None]


def _shard_filler(
    g: GroupMeta, specs: Mapping[str, RangeSpec], rank: int
) -> Callable[[int, torch.Tensor], None]:
    """Fill elements [start, start + out.numel()) of rank `rank`'s shard of `g` (padding 0)."""
    pieces = g.layout.slots_in_shard(rank)

    def fill(start: int, out: torch.Tensor) -> None:
        out.zero_()
        end = start + out.numel()
        for slot, piece in pieces:
            lo = max(start, piece.shard_start)
            hi = min(end, piece.shard_start + piece.numel)
            if lo < hi:
                at = piece.slot_start + lo - piece.shard_start
                specs[slot.name].read_range(at, out[lo - start : hi - start])

    return fill


def _write_streamed(path: Path, entries: Sequence[_Entry]) -> FileMeta:
    """Write a safetensors file chunk by chunk (the layout `write_file` gives); fsync it."""
    head, plan = plan_header(((e.key, e.dtype, e.shape) for e in entries), {"format": "pt"})
    crc = zlib.crc32(head)
    with open(path, "wb") as f:
        f.write(head)
        for e in entries:
            numel = math.prod(e.shape)
            chunk = torch.empty(min(CHUNK_ELEMENTS, numel), dtype=e.dtype)
            for start in range(0, numel, CHUNK_ELEMENTS):
                out = chunk[: min(CHUNK_ELEMENTS, numel - start)]
                e.fill(start, out)
                view = tensor_bytes(out)
                crc = zlib.crc32(view, crc)
                f.write(view)
                del view
        f.flush()
        os.fsync(f.fileno())
    return FileMeta(plan.size, f"{crc:08x}")


def convert_deepspeed(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    *,
    tag: str | None = None,
    world_size: int | None = None,
    workers: int | None = None,
    overwrite: bool = False,
) -> Path:
    """Write DeepSpeed checkpoint `src` as zeroshard checkpoint `dst/step-{step}` (with
    `latest`) of `world_size` rank files (default: DeepSpeed's); return its directory."""
    # Writing into the DeepSpeed checkpoint would replace its `latest` with ours.
    check_output_apart(src, dst)
    if is_zeroshard_checkpoint(Path(src), tag):
        # Its two-line `latest` would otherwise be read as DeepSpeed's one-line pointer.
        raise CheckpointError(
            f"{src} is a zeroshard checkpoint already, not a DeepSpeed one: it needs no "
            "conversion. Load it as it is (zs.load_checkpoint / zs.resume_checkpoint, at any "
            "world size and stage), or write its weights as safetensors with "
            "'zeroshard-ckpt consolidate'"
        )
    named = read_deepspeed_training_state(Path(src), tag)
    if named.experts:
        raise CheckpointError(
            f"{src}: a checkpoint of DeepSpeed MoE layers (expert parallelism) is not converted: "
            "its experts' placement has no place in the converted groups; load it with "
            "load_checkpoint directly, or write its weights with 'zeroshard-ckpt consolidate'"
        )
    size = world_size or named.world_size
    if size < 1:
        raise CheckpointError(f"world size must be >= 1, got {size}")
    groups = _groups(named, size)
    root, name = Path(dst), checkpoint_name(named.step)
    scale = named.loss_scale
    meta = CheckpointMeta(
        world_size=size,
        groups=tuple(g for g, _ in groups),
        stage=named.stage,
        step=named.step,
        param_groups=tuple(
            {k: _json(v) for k, v in pg.hyperparameters.items()} for pg in named.param_groups
        ),
        tied=dict(named.aliases),
        buffers=tuple(named.buffers),
        extra={
            CONVERTED_FROM: named.source,
            "loss_scaler": None
            if scale is None
            else {"scale": scale.scale, "good_steps": scale.good_steps},
            "not_carried": list(named.not_carried),
        },
    )
    _prepare(root, name, overwrite)
    tmp = temp_dir(root, name)

    def write_rank(rank: int) -> FileMeta:
        entries = [
            _Entry(
                shard_key(g.name, kind),
                torch.float32,
                (g.layout.shard_numel,),
                _shard_filler(g, specs, rank),
            )
            for g, sources in groups
            for kind, specs in sources.items()
        ]
        if rank == 0:
            entries += [
                _Entry(buffer_key(b), spec.dtype, spec.shape, spec.read_range)
                for b, spec in named.buffers.items()
            ]
        return _write_streamed(tmp / rank_file(rank), entries)

    try:
        with ThreadPoolExecutor(max(1, min(workers or default_workers(), size))) as pool:
            files = list(pool.map(write_rank, range(size)))
        fsync_dir(tmp)
        metas = {rank_file(r): f for r, f in enumerate(files)}
        _publish(root, name, meta.with_files(named.step, metas))
    except BaseException:
        # Nothing committed: drop the temp directory; earlier checkpoints under dst stay.
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return root / name
