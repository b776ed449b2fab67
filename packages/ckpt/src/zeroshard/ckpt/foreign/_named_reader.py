"""A converted zeroshard checkpoint (`convert_deepspeed`'s output) read by parameter name.

Its flat groups are DeepSpeed's param groups, not an engine's, so a resume reads each
parameter's elements from them (`NamedTrainingState`) instead of copying shard ranges.
Every rank file's size and checksum is verified before anything is read.
"""

from __future__ import annotations

import os
import weakref
from pathlib import Path

import torch

from zeroshard.ckpt._errors import CheckpointError
from zeroshard.ckpt._group_meta import GroupMeta
from zeroshard.ckpt._keys import MASTER, OPTIM_PREFIX, buffer_key
from zeroshard.ckpt._paths import resolve
from zeroshard.ckpt._reader import CheckpointReader, read_meta
from zeroshard.ckpt._writer import RangeSpec
from zeroshard.ckpt.foreign._convert import CONVERTED_FROM
from zeroshard.ckpt.foreign._named_state import LossScaleState, NamedParamGroup, NamedTrainingState


def is_converted_checkpoint(
    path: str | os.PathLike[str], tag: str | None = None, step: int | None = None
) -> bool:
    """Whether `path` (a checkpoint or a root) is a zeroshard checkpoint converted from
    another format, to be read by parameter name."""
    try:
        meta = read_meta(resolve(Path(path), tag, step))
    except (CheckpointError, OSError):
        return False
    return CONVERTED_FROM in meta.extra


def _slot_spec(reader: CheckpointReader, g: GroupMeta, kind: str, name: str) -> RangeSpec:
    slot = g.layout.slot(name)

    def read_range(start: int, out: torch.Tensor) -> None:
        lo = slot.offset + start
        reader.read_flat(g, kind, lo, lo + out.numel(), out)

    def read(out: torch.Tensor) -> None:
        read_range(0, out)

    return RangeSpec(name, slot.shape, g.shards[kind], read, read_range)


def _buffer_spec(reader: CheckpointReader, name: str) -> RangeSpec:
    entry = reader.buffer_entry(name)

    def read_range(start: int, out: torch.Tensor) -> None:
        reader.read_entry(0, buffer_key(name), start, out)

    return RangeSpec(name, entry.shape, entry.dtype, lambda out: read_range(0, out), read_range)


def _close(fds: dict[int, int]) -> None:
    for fd in fds.values():
        os.close(fd)
    fds.clear()


def read_named_state(
    path: str | os.PathLike[str], tag: str | None = None, step: int | None = None
) -> NamedTrainingState:
    """A converted checkpoint's weights, optimizer state, loss scale and step by name."""
    reader = CheckpointReader(path, tag=tag, step=step)
    meta = reader.meta
    reader.check_present()
    reader.verify()
    # The specs returned outlive this call and read through `reader`: its rank files
    # close when the last of them is dropped (its own fd table, closed by value).
    weakref.finalize(reader, _close, reader._fds)
    masters: dict[str, RangeSpec] = {}
    optimizer_state: dict[str, dict[str, RangeSpec]] = {}
    param_groups: list[NamedParamGroup] = []
    frozen: set[str] = set()
    for g in meta.groups:
        for slot in g.layout.slots:
            masters[slot.name] = _slot_spec(reader, g, MASTER, slot.name)
            for kind in g.shards:
                if kind.startswith(OPTIM_PREFIX):
                    key = kind[len(OPTIM_PREFIX) :]
                    optimizer_state.setdefault(key, {})[slot.name] = _slot_spec(
                        reader, g, kind, slot.name
                    )
        if not g.requires_grad:
            frozen.update(s.name for s in g.layout.slots)
            continue
        if g.param_group != len(param_groups):
            raise CheckpointError(f"{reader.path}: group {g.name!r} is out of param-group order")
        param_groups.append(
            NamedParamGroup(
                names=tuple(s.name for s in g.layout.slots),
                hyperparameters=dict(meta.param_groups[len(param_groups)]),
                scalars={k: float(v) for k, v in g.scalars.items()},
            )
        )
    scale = meta.extra.get("loss_scaler")
    return NamedTrainingState(
        source=f"{reader.path} (converted from {meta.extra[CONVERTED_FROM]})",
        stage=meta.stage,
        world_size=meta.world_size,
        step=meta.step,
        masters=masters,
        aliases=dict(meta.tied),
        buffers={b: _buffer_spec(reader, b) for b in meta.buffers},
        frozen=frozenset(frozen),
        param_groups=tuple(param_groups),
        optimizer_state=optimizer_state,
        loss_scale=None
        if scale is None
        else LossScaleState(float(scale["scale"]), int(scale["good_steps"])),
        not_carried=tuple(meta.extra.get("not_carried", ())),
    )
