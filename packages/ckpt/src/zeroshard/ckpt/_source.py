"""Consolidation specs from a zeroshard checkpoint: one `RangeSpec` per parameter and buffer.

A parameter's values come from its group's `master` shards when saved, else `param`;
each spec reads its slot's pieces straight from the rank files that hold them. Groups on
a process group of their own (experts) hold several instances under the same names: one
full state dict is one instance of each (`instance`), as `full_state_dict` gives on the
ranks holding it. The instances of a tensor-parallel group (`tensor_split`) are one model:
each split parameter's spec joins its pieces, the others read instance 0. Experts under
tensor parallelism (`expert_split`) are both: instance k of the full state dict is
expert k, its split parameters joined from its tensor-parallel ranks' pieces.
"""

from __future__ import annotations

import torch

from zeroshard.ckpt._errors import CheckpointError
from zeroshard.ckpt._group_meta import GroupMeta, check_experts_marked
from zeroshard.ckpt._keys import buffer_key
from zeroshard.ckpt._reader import CheckpointReader
from zeroshard.ckpt._spec import TensorSpec
from zeroshard.ckpt._tensor_split import read_full_range
from zeroshard.ckpt._writer import RangeSpec
from zeroshard.partition import Slot


def slot_spec(
    reader: CheckpointReader, group: GroupMeta, slot: Slot, kind: str, instance: int = 0
) -> RangeSpec:
    """Slot `slot` of `group`'s stored `kind` (`master`, `optim.exp_avg`, ...) as a full
    tensor (pieces joined under tensor parallelism), read from the rank files; of a group
    with several instances, instance `instance`'s (expert `instance`'s, under tensor
    parallelism)."""
    if group.tensor_split is not None or group.expert_split is not None:
        return _split_spec(reader, group, slot, kind, instance if group.experts > 1 else 0)

    def read_range(start: int, out: torch.Tensor) -> None:
        lo = slot.offset + start
        reader.read_flat(group, kind, lo, lo + out.numel(), out, instance)

    def read(out: torch.Tensor) -> None:
        read_range(0, out)

    return RangeSpec(slot.name, slot.shape, group.shards[kind], read, read_range)


def _split_spec(
    reader: CheckpointReader, group: GroupMeta, slot: Slot, kind: str, expert: int
) -> RangeSpec:
    def read_range(start: int, out: torch.Tensor) -> None:
        read_full_range(reader, group, kind, slot, start, out, expert)

    def read(out: torch.Tensor) -> None:
        read_range(0, out)

    return RangeSpec(slot.name, group.full_shape(slot), group.shards[kind], read, read_range)


def _buffer_spec(reader: CheckpointReader, name: str) -> RangeSpec:
    entry = reader.buffer_entry(name)
    key = buffer_key(name)

    def read_range(start: int, out: torch.Tensor) -> None:
        reader.read_entry(0, key, start, out)

    def read(out: torch.Tensor) -> None:
        read_range(0, out)

    return RangeSpec(name, entry.shape, entry.dtype, read, read_range)


def checkpoint_specs(
    reader: CheckpointReader, *, exclude_frozen: bool = False, instance: int | None = None
) -> tuple[list[TensorSpec], dict[str, str]]:
    """Specs of the full state dict (parameters in layout order, then buffers) and the
    tied aliases {alias: canonical}; aliases are not specs (their tensor is written once).
    `instance` picks one instance of the groups that have several (required then)."""
    meta = reader.meta
    # Instances per group that are different values: experts (each expert's run of
    # tensor-parallel ranks one instance, under tensor parallelism).
    several = {g.name: g.experts for g in meta.groups if g.experts > 1}
    if several and instance is None:
        raise CheckpointError(
            f"groups {sorted(several)} hold {max(several.values())} instances each (parameters "
            "on a process group of their own, e.g. experts, with different values on "
            "different ranks): consolidate one instance at a time (instance=k, --instance k)"
        )
    check_experts_marked(meta.groups)
    count = max(several.values(), default=1)
    if instance is not None and not 0 <= instance < count:
        raise CheckpointError(f"instance {instance} out of range: the checkpoint has {count}")
    specs: list[TensorSpec] = []
    for g in meta.groups:
        if exclude_frozen and not g.requires_grad:
            continue
        which = 0 if g.instances == 1 or instance is None else instance
        specs += [slot_spec(reader, g, s, g.value_kind, which) for s in g.layout.slots]
    specs += [_buffer_spec(reader, b) for b in meta.buffers]
    kept = {s.name for s in specs}
    aliases = {a: c for a, c in meta.tied.items() if c in kept}
    return specs, aliases
