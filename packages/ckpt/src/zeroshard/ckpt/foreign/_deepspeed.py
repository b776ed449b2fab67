"""DeepSpeed ZeRO checkpoints (stages 1, 2 and 3) as `TensorSpec`s, without DeepSpeed.

The output is what DeepSpeed's own `zero_to_fp32` produces, bit for bit: the same names,
the same values, in the same order: buffers first (floating ones as fp32), then frozen
parameters (in their saved dtype), then trainable parameters from the fp32 master
partitions, and shared (tied) parameters as aliases of the name that holds the data.
Nothing is read but names and shapes until a spec's `read` is called, and then only the
bytes of that tensor (see `_deepspeed_source`).

How the fp32 master weights are laid out, which is all the files do not say:

- ZeRO 1/2: per param group, every rank holds an equal slice of one flat vector; the
  group's parameters sit in it back to back, each followed by its entry of
  `param_alignment_paddings` when the checkpoint has them; the vector's tail is padding.
  MoE experts are the exception: each expert-parallel rank's have a vector of their own,
  sliced over fewer ranks, and are named by their global expert (`_deepspeed_moe`).
- ZeRO 3: every parameter is split on its own: rank r holds elements
  [r * ceil(n / W), (r + 1) * ceil(n / W)) of it (the last rank zero-padded), and each
  rank's param groups, concatenated, hold its slices of all parameters back to back.
  Frozen parameters are split the same way, one fragment per rank's model states file.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import torch

from zeroshard.ckpt._spec import TensorSpec
from zeroshard.ckpt._writer import RangeSpec
from zeroshard.ckpt.foreign._deepspeed_files import (
    DeepSpeedCheckpointError,
    MissingRankFileError,
    find_files,
    first_model_states,
    is_deepspeed_checkpoint,
    load_model_states,
    load_optim_states,
    resolve_tag_directory,
)
from zeroshard.ckpt.foreign._deepspeed_moe import expert_names
from zeroshard.ckpt.foreign._deepspeed_source import FlatSource, OpenFile
from zeroshard.ckpt.foreign._unpickle import CorruptFileError, UnsafePickleError

__all__ = [
    "CorruptFileError",
    "DeepSpeedCheckpoint",
    "DeepSpeedCheckpointError",
    "MissingRankFileError",
    "UnsafePickleError",
    "is_deepspeed_checkpoint",
    "read_deepspeed_checkpoint",
]


@dataclass(frozen=True)
class DeepSpeedCheckpoint:
    """What a DeepSpeed ZeRO checkpoint holds, as specs ready to consolidate."""

    directory: Path
    tag: str
    stage: int
    world_size: int
    step: int | None
    ds_version: str | None
    specs: tuple[TensorSpec, ...]
    aliases: Mapping[str, str]
    buffers: frozenset[str] = field(default_factory=frozenset)
    frozen: frozenset[str] = field(default_factory=frozenset)
    # MoE experts (`_deepspeed_moe`): local name -> its global name per expert-parallel
    # rank; `specs` hold every expert under its global name.
    experts: Mapping[str, tuple[str, ...]] = field(default_factory=dict)


class _Piece(NamedTuple):
    """Elements [src, src + length) of `source` go to out[dst : dst + length]."""

    source: FlatSource
    src: int
    dst: int
    length: int


def _reader(pieces: Sequence[_Piece]) -> Callable[[torch.Tensor], None]:
    def read(out: torch.Tensor) -> None:
        for piece in pieces:
            piece.source.read_into(out, piece.dst, piece.src, piece.length)

    return read


def _range_reader(pieces: Sequence[_Piece]) -> Callable[[int, torch.Tensor], None]:
    def read_range(start: int, out: torch.Tensor) -> None:
        end = start + out.numel()
        for piece in pieces:
            lo, hi = max(start, piece.dst), min(end, piece.dst + piece.length)
            if lo < hi:
                piece.source.read_into(out, lo - start, piece.src + lo - piece.dst, hi - lo)

    return read_range


def _spec(name: str, shape: Any, dtype: torch.dtype, pieces: Sequence[_Piece]) -> RangeSpec:
    """A spec whose big tensors the writer may read in chunks (`RangeSpec.read_range`)."""
    return RangeSpec(name, tuple(shape), dtype, _reader(pieces), _range_reader(pieces))


def _slices(
    sources: Sequence[FlatSource], starts: Sequence[int], begin: int, count: int, dst: int
) -> list[_Piece]:
    """Pieces covering elements [begin, begin + count) of the concatenation of `sources`."""
    pieces = []
    for source, start in zip(sources, starts, strict=True):
        lo, hi = max(begin, start), min(begin + count, start + source.numel)
        if lo < hi:
            pieces.append(_Piece(source, lo - start, dst + lo - begin, hi - lo))
    return pieces


def _cumulative(sources: Sequence[FlatSource]) -> list[int]:
    starts, total = [], 0
    for s in sources:
        starts.append(total)
        total += s.numel
    return starts


def _numel(shape: Any) -> int:
    return math.prod(int(d) for d in shape)


def _flat_sources(tensors: Any, file: OpenFile, what: str, rank: int, key: str) -> list[FlatSource]:
    if not isinstance(tensors, (list, tuple)) or not all(
        isinstance(t, torch.Tensor) for t in tensors
    ):
        raise DeepSpeedCheckpointError(f"{file.path}: {key} is not a list of tensors")
    return [FlatSource(t, file, f"{what} rank {rank} group {g}") for g, t in enumerate(tensors)]


def _zero12_group(
    parts: Sequence[FlatSource],
    shapes: Mapping[str, Any],
    pads: Sequence[int] | None,
    label: str,
    specs: dict[str, TensorSpec],
) -> None:
    """The parameters of one ZeRO 1/2 param group, from its ranks' partitions in order."""
    starts = _cumulative(parts)
    total = starts[-1] + parts[-1].numel
    if pads is not None and len(pads) != len(shapes):
        raise DeepSpeedCheckpointError(
            f"{label}: {len(pads)} alignment paddings for {len(shapes)} parameters"
        )
    offset = 0
    for i, (name, shape) in enumerate(shapes.items()):
        n = _numel(shape)
        if offset + n > total:
            raise DeepSpeedCheckpointError(
                f"{label}: parameter {name!r} needs elements up to {offset + n} but the "
                f"ranks' partitions hold {total}"
            )
        pieces = _slices(parts, starts, offset, n, 0)
        specs[name] = _spec(name, shape, torch.float32, pieces)
        offset += n + (pads[i] if pads is not None else 0)
    # The flat vector is padded to a multiple of 2 * its ranks (as DeepSpeed checks).
    align = 2 * len(parts)
    if align * math.ceil(offset / align) != align * math.ceil(total / align):
        raise DeepSpeedCheckpointError(
            f"{label}: the parameters use {offset} elements of {total}: "
            "param_shapes and the optimizer partitions do not match"
        )


def _zero12_trainable(
    groups: Sequence[Sequence[FlatSource]],
    param_shapes: Sequence[Mapping[str, Any]],
    paddings: Sequence[Sequence[int]] | None,
    world_size: int,
    specs: dict[str, TensorSpec],
    experts: Mapping[str, tuple[str, ...]],
) -> None:
    """Every param group's parameters; an MoE expert group's (`experts`: local name -> its
    global names) once per expert-parallel rank k, from the partitions of ranks k, k + P,
    ... under its experts' global names (`_deepspeed_moe`)."""
    if len(param_shapes) != len(groups[0]):
        raise DeepSpeedCheckpointError(
            f"param_shapes has {len(param_shapes)} groups but the optimizer files {len(groups[0])}"
        )
    for g, shapes in enumerate(param_shapes):
        pads = None if paddings is None else list(paddings[g])
        ep = len(experts.get(next(iter(shapes), ""), ()))
        if ep == 0:
            parts = [groups[r][g] for r in range(world_size)]
            _zero12_group(parts, shapes, pads, f"group {g}", specs)
            continue
        for k in range(ep):
            parts = [groups[r][g] for r in range(k, world_size, ep)]
            renamed = {experts[n][k]: shape for n, shape in shapes.items()}
            _zero12_group(parts, renamed, pads, f"group {g} of expert-parallel rank {k}", specs)


def _zero3_trainable(
    groups: Sequence[Sequence[FlatSource]],
    param_shapes: Sequence[Mapping[str, Any]],
    world_size: int,
    specs: dict[str, TensorSpec],
) -> None:
    sizes = [[s.numel for s in rank_groups] for rank_groups in groups]
    if any(s != sizes[0] for s in sizes):
        raise DeepSpeedCheckpointError(f"ranks hold fp32 groups of different sizes: {sizes}")
    starts = _cumulative(groups[0])
    total = sum(sizes[0])
    merged: dict[str, Any] = {}
    for shapes in param_shapes:
        merged.update(shapes)
    offset = 0
    for name, shape in merged.items():
        n = _numel(shape)
        part = math.ceil(n / world_size)
        if offset + part > total:
            raise DeepSpeedCheckpointError(
                f"parameter {name!r} needs partition elements up to {offset + part} but each "
                f"rank holds {total}"
            )
        pieces: list[_Piece] = []
        for r in range(world_size):
            count = min(part, n - r * part)
            if count > 0:
                pieces += _slices(groups[r], starts, offset, count, r * part)
        specs[name] = _spec(name, shape, torch.float32, pieces)
        offset += part
    if offset != total:
        raise DeepSpeedCheckpointError(
            f"the parameters use {offset} elements of each rank's {total}: "
            "param_shapes and the optimizer partitions do not match"
        )


def _frozen(
    models: Sequence[dict[str, Any]],
    files: Sequence[OpenFile],
    stage: int,
    specs: dict[str, TensorSpec],
) -> set[str]:
    shapes = models[0].get("frozen_param_shapes")
    if not shapes:
        return set()
    for name, shape in shapes.items():
        n = _numel(shape)
        frags = []
        for rank, (model, file) in enumerate(zip(models, files, strict=True)):
            fragments = model.get("frozen_param_fragments") or {}
            if name not in fragments:
                raise DeepSpeedCheckpointError(
                    f"{file.path}: frozen parameter {name!r} has no fragment"
                )
            frags.append(FlatSource(fragments[name], file, f"frozen {name!r} rank {rank}"))
        if stage < 3:
            frags = frags[:1]  # ZeRO 1/2 keep frozen parameters whole, on rank 0
        available = sum(f.numel for f in frags)
        if available < n or (stage < 3 and available != n):
            raise DeepSpeedCheckpointError(
                f"frozen parameter {name!r} of shape {tuple(shape)} has {available} elements "
                "in its fragments"
            )
        dtypes = {f.dtype for f in frags}
        if len(dtypes) != 1:
            raise DeepSpeedCheckpointError(f"frozen parameter {name!r}: fragments of {dtypes}")
        pieces = _slices(frags, _cumulative(frags), 0, n, 0)
        specs[name] = _spec(name, shape, frags[0].dtype, pieces)
    return set(shapes)


def _buffers(model: dict[str, Any], file: OpenFile, specs: dict[str, TensorSpec]) -> set[str]:
    names = set(model["buffer_names"])
    found = set()
    for name, tensor in model["module"].items():
        if name not in names:
            continue
        # DeepSpeed's zero_to_fp32 returns floating buffers as fp32 (`.float()`); the copy
        # into an fp32 output does the same widening, exactly.
        dtype = torch.float32 if tensor.is_floating_point() else tensor.dtype
        source = FlatSource(tensor, file, f"buffer {name!r}")
        pieces = [_Piece(source, 0, 0, source.numel)]
        specs[name] = _spec(name, tensor.shape, dtype, pieces)
        found.add(name)
    return found


def read_deepspeed_checkpoint(
    path: Path, tag: str | None = None, *, exclude_frozen: bool = False
) -> DeepSpeedCheckpoint:
    """Read the layout of a DeepSpeed ZeRO 1/2/3 checkpoint (root with `latest`, or tag dir)."""
    directory, tag = resolve_tag_directory(Path(path), tag)
    model0_path = first_model_states(directory)
    model0 = load_model_states(model0_path)
    world_size = int(model0.get("dp_world_size") or 0)
    if world_size < 1:
        world_size = len(list(directory.glob("*_optim_states.pt")))
    partitioned = model0_path.name.startswith("zero_pp_rank_")
    files = find_files(directory, tag, world_size, 3 if partitioned else 2)
    optim = [load_optim_states(p) for p in files.optim_states]
    stage = int(optim[0]["zero_stage"])
    if stage not in (1, 2, 3):
        raise DeepSpeedCheckpointError(
            f"{files.optim_states[0]}: ZeRO stage {stage}; only stages 1, 2 and 3 partition "
            "the fp32 weights the way zero_to_fp32 (and this reader) expect"
        )
    if (stage == 3) != partitioned:
        raise DeepSpeedCheckpointError(
            f"{files.optim_states[0]}: ZeRO stage {stage} does not match the model states "
            f"file {model0_path.name}"
        )
    for p, o in zip(files.optim_states, optim, strict=True):
        count = o.get("partition_count")
        # MoE experts are partitioned over fewer ranks (`_deepspeed_moe`).
        count = max(count) if isinstance(count, (list, tuple)) else count
        if count != world_size:
            raise DeepSpeedCheckpointError(
                f"{p}: partitioned over {count} ranks, but the checkpoint's world size is "
                f"{world_size}"
            )
    optim_files = [OpenFile(p) for p in files.optim_states]
    key = "fp32_flat_groups" if stage == 3 else "single_partition_of_fp32_groups"
    groups = [
        _flat_sources(o.get(key), f, "fp32 partition", r, key)
        for r, (o, f) in enumerate(zip(optim, optim_files, strict=True))
    ]
    models = [model0] + [load_model_states(p) for p in files.model_states[1:]]
    model_files = [OpenFile(p) for p in files.model_states]

    specs: dict[str, TensorSpec] = {}
    buffers = _buffers(model0, model_files[0], specs)
    frozen = set() if exclude_frozen else _frozen(models, model_files, stage, specs)
    experts: dict[str, tuple[str, ...]] = {}
    if stage == 3:
        if model0.get("num_experts"):
            raise DeepSpeedCheckpointError(
                f"{directory}: a ZeRO-3 checkpoint of MoE layers: its experts' layout is read "
                "at ZeRO 1/2 only"
            )
        _zero3_trainable(groups, model0["param_shapes"], world_size, specs)
    else:
        counts = optim[0]["partition_count"]
        if not isinstance(counts, (list, tuple)):
            counts = [counts] * len(model0["param_shapes"])
        experts = expert_names(directory, model0, counts, world_size)
        paddings = optim[0].get("param_alignment_paddings")
        _zero12_trainable(groups, model0["param_shapes"], paddings, world_size, specs, experts)
    aliases: dict[str, str] = {}
    for shared, canonical in (model0.get("shared_params") or {}).items():
        if canonical in specs:
            specs.pop(shared, None)
            aliases[shared] = canonical
    step = model0.get("global_steps")
    version = model0.get("ds_version")
    return DeepSpeedCheckpoint(
        directory=directory,
        tag=tag,
        stage=stage,
        world_size=world_size,
        step=int(step) if isinstance(step, int) else None,
        ds_version=str(version) if version is not None else None,
        specs=tuple(specs.values()),
        aliases=aliases,
        buffers=frozenset(buffers & specs.keys()),
        frozen=frozenset(frozen & specs.keys()),
        experts=experts,
    )
