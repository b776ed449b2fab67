"""`load`: this rank's shards for any world size, read by byte range, checksums verified.

Resharding needs no data movement between ranks: a target rank's shard is a range of
the padded flat buffer (offsets do not depend on the world size), so it reads exactly
that range from the one or two source rank files that hold it. With target layouts
whose offsets differ (another alignment), each slot is copied on its own instead.
A group on a process group of its own (experts) is read for the instance and the rank
in that group that `placements` names (see `GroupMeta.rank_sets`). Tensor-parallel groups
(`GroupMeta.tensor_split`), and experts under tensor parallelism (`expert_split`), load at
any tensor-parallel size, or none: where the target cuts a parameter as the checkpoint
does, its instance is read as above, else its piece is cut from the full tensor (the
expert's) ([Note: recutting tensor-parallel pieces] in _tensor_split).

[Note: names and shapes are the contract]
Target layouts may also group the parameters differently from the checkpoint (saved at
another ZeRO stage, `reduce_bucket_bytes` or `min_unit_params`): then each target slot
is read from whichever checkpoint group holds that parameter name. Only the kinds of
state must match: a target group whose parameters come from checkpoint groups that
store different kinds (a frozen and a trainable one) is an error saying so.
"""

from __future__ import annotations

import os
from collections.abc import Collection, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

import torch

from zeroshard.ckpt._errors import CheckpointError, ModelMismatchError
from zeroshard.ckpt._extra import RankExtra, read_extra
from zeroshard.ckpt._group_meta import GroupMeta, TensorSplit, check_experts_marked
from zeroshard.ckpt._keys import BUFFER_PREFIX, buffer_key, shard_key
from zeroshard.ckpt._meta import CheckpointMeta, check_names_shapes
from zeroshard.ckpt._reader import CheckpointReader
from zeroshard.ckpt._tensor_split import read_region
from zeroshard.partition import FlatLayout, Slot


class GroupPlacement(NamedTuple):
    """Where the loading rank sits in a group sharded over a process group of its own:
    it holds instance `instance` of `instances` (e.g. its expert-parallel index), as
    rank `rank` of that group (whose size is the target layout's world size). `split`:
    the instances are tensor-parallel ranks, whose pieces of the parameters it names are
    cut as it says (see `TensorSplit`; the target layout's slots are the pieces); with
    `split.ranks` (experts under tensor parallelism, as `GroupMeta.expert_split`) they
    come in runs of `ranks`, run e expert e's tensor-parallel ranks."""

    instance: int
    instances: int
    rank: int
    split: TensorSplit | None = None

    @property
    def pieces(self) -> int:
        """How many pieces a split slot is cut into (as `GroupMeta.pieces`)."""
        if self.split is None:
            return 1
        return self.split.ranks or self.instances

    @property
    def expert(self) -> int:
        """Which of the instances holding different values (experts) this rank holds: 0
        of a tensor-parallel group's (one model)."""
        return self.instance // self.pieces

    @property
    def experts(self) -> int:
        """How many of the instances hold different values (as `GroupMeta.experts`)."""
        return self.instances // self.pieces

    def full_shape(self, slot: Slot) -> tuple[int, ...]:
        """The shape of the whole tensor whose piece target slot `slot` is."""
        dim = None if self.split is None else self.split.dims.get(slot.name)
        if dim is None:
            return slot.shape
        return tuple(n * self.pieces if d == dim else n for d, n in enumerate(slot.shape))

    def cut(self, slot: Slot) -> tuple[int | None, int, int]:
        """The dim target slot `slot` is cut along, and its piece's [lo, hi) of the full
        tensor along it (None, 0, 0 when it holds the whole tensor)."""
        dim = None if self.split is None else self.split.dims.get(slot.name)
        if dim is None:
            return None, 0, 0
        n, k = slot.shape[dim], self.instance % self.pieces
        return dim, k * n, (k + 1) * n


@dataclass(frozen=True)
class LoadedShards:
    """One rank's shards of a checkpoint, for the world size it was loaded at.

    `tensors` holds `shard_key(group, kind)` -> 1-D shard of `layouts[group].shard_numel`
    elements (the saved dtype), and `buffer_key(name)` -> each buffer, whole.
    """

    meta: CheckpointMeta
    path: Path
    rank: int
    world_size: int
    layouts: Mapping[str, FlatLayout]
    tensors: Mapping[str, torch.Tensor]
    # Target group -> the checkpoint group that gave it its kinds and optimizer scalars.
    sources: Mapping[str, GroupMeta] = field(default_factory=dict)
    # Rank file number -> its extra state, for the `extras` asked for that have one.
    extras: Mapping[int, RankExtra] = field(default_factory=dict)
    # Parameter name -> its whole-parameter state tensors, for the `param_states` asked for.
    param_states: Mapping[str, Mapping[str, torch.Tensor]] = field(default_factory=dict)

    def shard(self, group: str, kind: str) -> torch.Tensor:
        """This rank's shard of `group` of one kind ('master', 'param', 'optim.exp_avg')."""
        try:
            return self.tensors[shard_key(group, kind)]
        except KeyError:
            raise KeyError(f"no {kind!r} shard of group {group!r} was loaded") from None

    @property
    def buffers(self) -> dict[str, torch.Tensor]:
        """Module buffers by name."""
        n = len(BUFFER_PREFIX)
        return {k[n:]: t for k, t in self.tensors.items() if k.startswith(BUFFER_PREFIX)}


def checkpoint_shapes(reader: CheckpointReader) -> dict[str, tuple[int, ...]]:
    """Every name a model's state_dict() would hold (params, tied aliases, buffers) -> shape."""
    meta = reader.meta
    shapes = {s.name: g.full_shape(s) for g in meta.groups for s in g.layout.slots}
    shapes.update({alias: shapes[c] for alias, c in meta.tied.items() if c in shapes})
    shapes.update({b: reader.buffer_entry(b).shape for b in meta.buffers})
    return shapes


def _placements(
    sources: Mapping[str, Sequence[GroupMeta]], rank: int, given: Mapping[str, GroupPlacement]
) -> dict[str, GroupPlacement]:
    """Every target group's placement of this rank (a group on the whole world: instance
    0 of 1, as rank `rank`); ModelMismatchError when the numbers of experts differ."""
    unknown = sorted(set(given) - set(sources))
    if unknown:
        raise ModelMismatchError(f"placements name groups the target layouts lack: {unknown}")
    out = {}
    for name, groups in sources.items():
        place = given.get(name, GroupPlacement(0, 1, rank))
        if not 0 <= place.instance < place.instances or place.instances % place.pieces:
            raise ValueError(f"group {name!r}: bad placement {place}")
        # Tensor-parallel pieces are one model at any tensor-parallel size, an expert's
        # one expert; independent instances (experts) load only as many of them.
        for g in groups:
            if g.experts == place.experts:
                continue
            if place.split is not None and not place.split.ranks:
                raise ModelMismatchError(
                    f"group {g.name!r} was saved with {g.experts} instances holding "
                    "different values (e.g. experts), this run splits it by tensor parallelism"
                )
            raise ModelMismatchError(
                f"group {g.name!r} was saved with {g.experts} instance(s) (sets of ranks "
                f"holding different values, e.g. experts), this run has {place.experts}"
            )
        out[name] = place
    return out


def _target_layouts(
    meta: CheckpointMeta,
    world_size: int,
    layouts: Mapping[str, FlatLayout] | None,
    placed: Mapping[str, GroupPlacement],
) -> dict[str, FlatLayout]:
    if layouts is None:
        if placed:
            raise ValueError("placements need the target layouts (layouts=...)")
        if any(g.tensor_split is not None and g.instances > 1 for g in meta.groups):
            raise CheckpointError(
                "the checkpoint's parameters are split by tensor parallelism: give the "
                "target layouts (layouts=...), or consolidate it"
            )
        return {g.name: g.layout.resharded(world_size) for g in meta.groups}

    def full(name: str, dst: FlatLayout) -> dict[str, tuple[int, ...]]:
        place = placed.get(name, GroupPlacement(0, 1, 0))
        return {s.name: place.full_shape(s) for s in dst.slots}

    for name, dst in layouts.items():
        if name not in placed and dst.world_size != world_size:
            raise CheckpointError(
                f"layout of group {name!r} is for world size {dst.world_size}, not {world_size}"
            )
    have = {g.name: g for g in meta.groups}
    # Group names alone do not say the grouping is the same: at another stage the
    # checkpoint's `group0` may hold other parameters than this run's `group0`.
    if have.keys() == layouts.keys() and all(
        {s.name for s in g.layout.slots} == {s.name for s in layouts[g.name].slots}
        for g in meta.groups
    ):
        for g in meta.groups:
            check_names_shapes(
                {s.name: g.full_shape(s) for s in g.layout.slots},
                full(g.name, layouts[g.name]),
                f"group {g.name!r} of the checkpoint",
            )
    else:  # grouped differently: see [Note: names and shapes are the contract]
        wanted: dict[str, tuple[int, ...]] = {}
        for name, dst in layouts.items():
            wanted.update(full(name, dst))
        check_names_shapes(
            {s.name: g.full_shape(s) for g in meta.groups for s in g.layout.slots},
            wanted,
            "the checkpoint's parameters",
        )
    return dict(layouts)


_Copy = tuple[GroupMeta, int, int, int]  # source group, src_lo, src_hi, dst_start
# A piece of a target slot cut from a tensor-parallel source: source group, its slot, the
# target's cut (dim, lo, hi), the piece's start and length in the target slot, dst_start.
_Recut = tuple[GroupMeta, Slot, tuple[int | None, int, int], int, int, int]


def _cut_alike(sources: Sequence[GroupMeta], dst: FlatLayout, place: GroupPlacement) -> bool:
    """Whether `dst`'s slots are the sources' own slots of instance `place.instance`: no
    tensor parallelism on either side, or the same on both."""
    for g in sources:
        split = g.tensor_split if g.expert_split is None else g.expert_split
        if split is None and place.split is None:
            continue
        if (
            split is None
            or place.split is None
            or g.instances != place.instances
            or g.pieces != place.pieces
        ):
            return False
        names = {s.name for s in g.layout.slots}
        if any(
            g.split_dim(s.name) != place.split.dims.get(s.name)
            for s in dst.slots
            if s.name in names
        ):
            return False
    return True


def _recuts(sources: Sequence[GroupMeta], dst: FlatLayout, place: GroupPlacement) -> list[_Recut]:
    """The pieces of `dst`'s shard of `place.rank`, each cut from its full tensor."""
    owner = {s.name: g for g in sources for s in g.layout.slots}
    out = []
    for slot, piece in dst.slots_in_shard(place.rank):
        g = owner[slot.name]
        src = g.layout.slot(slot.name)
        out.append((g, src, place.cut(slot), piece.slot_start, piece.numel, piece.shard_start))
    return out


def _sources(meta: CheckpointMeta, targets: Mapping[str, FlatLayout]) -> dict[str, list[GroupMeta]]:
    """Target group -> the checkpoint groups its parameters come from (same kinds)."""
    by_name = {g.name: g for g in meta.groups}
    owner = {s.name: g for g in meta.groups for s in g.layout.slots}
    out: dict[str, list[GroupMeta]] = {}
    for name, dst in targets.items():
        names = {s.name for s in dst.slots}
        if name in by_name and names == {s.name for s in by_name[name].layout.slots}:
            groups = [by_name[name]]
        else:
            groups = list({owner[n].name: owner[n] for n in sorted(names)}.values())
        kinds = {g.name: dict(g.shards) for g in groups}
        if len({tuple(sorted(k.items(), key=str)) for k in kinds.values()}) > 1:
            raise CheckpointError(
                f"group {name!r} takes parameters from checkpoint groups that store "
                f"different state: {kinds} (a frozen and a trainable group?)"
            )
        out[name] = groups
    return out


def _copies(sources: Sequence[GroupMeta], dst: FlatLayout, rank: int) -> list[_Copy]:
    """Element ranges of the source groups that make up `dst`'s shard of `rank`."""
    a, b = dst.shard_range(rank)
    src = sources[0]
    if len(sources) == 1 and [(s.name, s.offset) for s in src.layout.slots] == [
        (s.name, s.offset) for s in dst.slots
    ]:
        # Same offsets: the shard is one range of the flat buffer, alignment gaps included.
        hi = min(b, src.layout.padded_numel)
        return [(src, a, hi, 0)] if a < hi else []
    owner = {s.name: g for g in sources for s in g.layout.slots}
    out = []
    for slot, piece in dst.slots_in_shard(rank):
        g = owner[slot.name]
        lo = g.layout.slot(slot.name).offset + piece.slot_start
        out.append((g, lo, lo + piece.numel, piece.shard_start))
    return out


def load(
    path: str | os.PathLike[str],
    *,
    rank: int,
    world_size: int,
    tag: str | None = None,
    step: int | None = None,
    expected: Mapping[str, Sequence[int]] | None = None,
    layouts: Mapping[str, FlatLayout] | None = None,
    placements: Mapping[str, GroupPlacement] | None = None,
    kinds: Collection[str] | None = None,
    device: torch.device | str = "cpu",
    verify: bool = True,
    workers: int = 4,
    extras: Collection[int] = (),
    param_states: Collection[str] = (),
) -> LoadedShards:
    """Read rank `rank`'s shards for `world_size` ranks (any world size) and the buffers.

    `path` is a checkpoint directory or a root (then `tag`, `step` or `latest`).
    `expected` (name -> shape, as the model's state_dict() has them) raises
    ModelMismatchError listing every difference. `layouts` gives target layouts per
    group (default: the saved ones resharded). `placements` places this rank in the
    groups on a process group of their own (experts; their layouts give that group's
    size). `kinds` limits which shard kinds are read. `verify` checks the size and
    checksum of every file read. `extras` names the rank files whose extra state
    (`RankExtra`) is read too, of those the checkpoint has (`LoadedShards.extras` holds
    the ones with an extra). `param_states` names the parameters whose whole-parameter
    optimizer state is read (`CheckpointMeta.param_states`; a name it lacks is a
    CheckpointError). No collectives.
    """
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} out of range for world size {world_size}")
    with CheckpointReader(path, tag=tag, step=step) as reader:
        meta = reader.meta
        reader.check_present()
        check_experts_marked(meta.groups)
        if verify and meta.buffers:
            # Rank 0's file holds the buffers, whose shapes `expected` is checked against:
            # its header is read only once the file is known intact.
            reader.verify({0}, workers)
        if expected is not None:
            check_names_shapes(checkpoint_shapes(reader), expected, f"checkpoint {reader.path}")
        targets = _target_layouts(meta, world_size, layouts, placements or {})
        if kinds is not None:
            unknown = set(kinds) - {k for g in meta.groups for k in g.shards}
            if unknown:
                raise CheckpointError(f"no group stores shard kind(s) {sorted(unknown)}")
        sources = _sources(meta, targets)
        places = _placements(sources, rank, placements or {})
        plan: list[tuple[str, GroupMeta, str, list[_Copy], list[_Recut]]] = []
        extra_ranks = sorted(r for r in set(extras) if 0 <= r < meta.world_size)
        lacking = sorted(set(param_states) - set(meta.param_states))
        if lacking:
            raise CheckpointError(
                f"checkpoint {reader.path} keeps no whole-parameter optimizer state for "
                f"{lacking[:5]}: was it saved with another optimizer for them?"
            )
        needed = {0, *extra_ranks, *(meta.param_states[n].rank for n in param_states)}
        for name, groups in sources.items():
            place = places[name]
            copies: list[_Copy] = []
            recuts: list[_Recut] = []
            if _cut_alike(groups, targets[name], place):
                copies = _copies(groups, targets[name], place.rank)
                for g, lo, hi, _ in copies:
                    n = g.layout.shard_numel
                    pieces = range(lo // n, (hi - 1) // n + 1)
                    needed.update(g.file_rank(place.instance, r) for r in pieces)
            else:
                recuts = _recuts(groups, targets[name], place)
                needed.update(
                    g.file_rank(i, r)
                    for g in groups
                    for i in range(place.expert * g.pieces, (place.expert + 1) * g.pieces)
                    for r in range(g.layout.world_size)
                )
            first = groups[0]
            plan += [
                (name, first, k, copies, recuts)
                for k in first.shards
                if kinds is None or k in kinds
            ]
        if verify:
            reader.verify(needed, workers)

        def read(item: tuple[str, GroupMeta, str, list[_Copy], list[_Recut]]) -> torch.Tensor:
            name, first, kind, copies, recuts = item
            out = torch.zeros(targets[name].shard_numel, dtype=first.shards[kind])
            for g, lo, hi, at in copies:
                reader.read_flat(g, kind, lo, hi, out[at : at + hi - lo], places[name].instance)
            for g, src, cut, start, n, at in recuts:
                region = read_region(reader, g, kind, src, cut, places[name].expert)
                out[at : at + n] = region.reshape(-1)[start : start + n]
            return out

        with ThreadPoolExecutor(max(1, workers)) as pool:
            shards = list(pool.map(read, plan))
        tensors = {shard_key(n, k): t for (n, _, k, _, _), t in zip(plan, shards, strict=True)}
        tensors.update({buffer_key(b): reader.read_buffer(b) for b in meta.buffers})
        found = {r: read_extra(reader, r) for r in extra_ranks}
        whole = {n: reader.read_param_state(n) for n in sorted(set(param_states))}
    if torch.device(device).type != "cpu":
        tensors = {k: t.to(device) for k, t in tensors.items()}
    firsts = {name: groups[0] for name, groups in sources.items()}
    kept = {r: e for r, e in found.items() if e is not None}
    return LoadedShards(meta, reader.path, rank, world_size, targets, tensors, firsts, kept, whole)
