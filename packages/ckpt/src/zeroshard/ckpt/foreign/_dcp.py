"""PyTorch DCP checkpoints (FSDP2, torchtitan, `dcp.save`) as `TensorSpec`s for consolidation.

Every tensor entry of the `.metadata` becomes one spec of its global shape and saved
dtype, read from the chunks the ranks saved (see [Note: DCP on disk] in `_dcp_pickle`);
the output equals torch's `dcp_to_torch_save`, bit for bit. Optimizer state (entries
under a top-level `optimizer` or `optim` key, as torchtitan and the DCP tutorials save
it) and non-tensor entries (bytes: a step counter, a dataloader's state) are skipped. Names
drop torch.compile's `_orig_mod` segments (a `model.state_dict()` of a compiled model
saved as it is), as everything zeroshard writes does (see `_names`).

Chunks that split a tensor along its first dimension only (FSDP2's even sharding, and
any replicated tensor) are contiguous runs of the flat tensor: their specs are
`RangeSpec`s, read piecewise by positioned reads, so the writer's memory bound holds.
Other chunkings (tensor parallel splits of later dimensions) are read whole per tensor.
"""

from __future__ import annotations

import dataclasses
import math
import os
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from zeroshard.ckpt._errors import CheckpointError
from zeroshard.ckpt._names import canonical_name
from zeroshard.ckpt._spec import TensorSpec
from zeroshard.ckpt._stfile import pread_into
from zeroshard.ckpt._writer import RangeSpec
from zeroshard.ckpt.foreign._dcp_pickle import ChunkBytes, load_metadata, locate_chunk
from zeroshard.ckpt.foreign._unpickle import CorruptFileError

DCP_METADATA = ".metadata"
SKIPPED_KEYS = ("optimizer", "optim")


def is_dcp_checkpoint(path: Path) -> bool:
    """True if `path` is a directory written by `torch.distributed.checkpoint`."""
    return path.is_dir() and (path / DCP_METADATA).is_file()


class _Files:
    """Read-only descriptors of the checkpoint's `.distcp` files, closed with this object."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._fds: dict[str, int] = {}
        weakref.finalize(self, _close_all, self._fds)

    def fd(self, name: str, fqn: str) -> int:
        """The descriptor of file `name` (relative to the checkpoint), opened once."""
        if name not in self._fds:
            path = self.root / name
            if Path(name).name != name:
                raise CorruptFileError(f"{self.root / DCP_METADATA}: bad file name {name!r}")
            try:
                self._fds[name] = os.open(path, os.O_RDONLY)
            except FileNotFoundError:
                raise CheckpointError(
                    f"{path} is missing: the .metadata puts a chunk of {fqn!r} in it "
                    "(half-copied or half-written checkpoint?)"
                ) from None
        return self._fds[name]


def _close_all(fds: dict[str, int]) -> None:
    for fd in fds.values():
        os.close(fd)


@dataclass(frozen=True)
class _Chunk:
    """A saved chunk: its box in the global tensor and where its bytes are."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    path: Path
    fd: int
    data: ChunkBytes
    files: _Files  # keeps `fd` open as long as a spec reads this chunk


def _chunks(
    by_key: dict[tuple[str, tuple[int, ...]], Any], fqn: str, entry: Any, files: _Files
) -> list[_Chunk]:
    out = []
    for c in entry.chunks:
        offsets, sizes = tuple(int(x) for x in c.offsets), tuple(int(x) for x in c.sizes)
        info = by_key.get((fqn, offsets))
        if info is None:
            raise CorruptFileError(
                f"{files.root / DCP_METADATA}: chunk {list(offsets)} of {fqn!r} has no storage"
            )
        if getattr(info, "transform_descriptors", None):
            raise CheckpointError(
                f"{files.root / info.relative_path}: {fqn!r} is saved through storage "
                f"transforms {info.transform_descriptors}; only plain DCP files are read"
            )
        fd = files.fd(info.relative_path, fqn)
        path = files.root / info.relative_path
        data = locate_chunk(fd, path, int(info.offset), int(info.length), fqn)
        if data.dtype != entry.properties.dtype or data.numel != math.prod(sizes):
            raise CorruptFileError(
                f"{path}: chunk {list(offsets)} of {fqn!r} holds {data.numel} {data.dtype} "
                f"elements, the .metadata says {math.prod(sizes)} {entry.properties.dtype}"
            )
        out.append(_Chunk(offsets, sizes, path, fd, data, files))
    return out


def _rows_only(shape: tuple[int, ...], chunks: Sequence[_Chunk]) -> bool:
    """Whether every chunk is whole rows (split along dimension 0 only)."""
    return all(
        c.offsets[1:] == (0,) * (len(shape) - 1) and c.sizes[1:] == shape[1:] for c in chunks
    )


def _read_chunk(chunk: _Chunk, out: torch.Tensor, first: int) -> None:
    """Elements [first, first + out.numel()) of `chunk` into contiguous CPU `out`."""
    offset = chunk.data.offset + first * chunk.data.dtype.itemsize
    pread_into(chunk.fd, out, offset, chunk.path, CorruptFileError)


def _row_spec(
    fqn: str, shape: tuple[int, ...], dtype: torch.dtype, chunks: list[_Chunk]
) -> RangeSpec:
    row = math.prod(shape[1:]) if shape else 1
    runs = sorted(((c.offsets[0] * row if shape else 0), c) for c in chunks)
    covered = 0
    for start, c in runs:
        if start != covered:
            raise CorruptFileError(
                f"{c.path}: the chunks of {fqn!r} leave or overlap elements at {covered}"
            )
        covered += c.data.numel
    if covered != math.prod(shape):
        raise CorruptFileError(
            f"the chunks of {fqn!r} cover {covered} of {math.prod(shape)} elements"
        )

    def read_range(start: int, out: torch.Tensor) -> None:
        end = start + out.numel()
        for first, c in runs:
            lo, hi = max(start, first), min(end, first + c.data.numel)
            if lo < hi:
                _read_chunk(c, out[lo - start : hi - start], lo - first)

    def read(out: torch.Tensor) -> None:
        read_range(0, out)

    return RangeSpec(fqn, shape, dtype, read, read_range)


def _box_spec(
    fqn: str, shape: tuple[int, ...], dtype: torch.dtype, chunks: list[_Chunk]
) -> TensorSpec:
    for c in chunks:
        if len(c.offsets) != len(shape) or any(
            o < 0 or o + s > d for o, s, d in zip(c.offsets, c.sizes, shape, strict=True)
        ):
            raise CorruptFileError(f"{c.path}: chunk {list(c.offsets)} lies outside {fqn!r}")
    if sum(c.data.numel for c in chunks) != math.prod(shape):
        raise CorruptFileError(f"the chunks of {fqn!r} do not cover its {list(shape)} exactly")

    def read(out: torch.Tensor) -> None:
        full = out.view(shape)
        for c in chunks:
            part = torch.empty(c.data.numel, dtype=dtype)
            _read_chunk(c, part, 0)
            box = tuple(slice(o, o + s) for o, s in zip(c.offsets, c.sizes, strict=True))
            full[box].copy_(part.view(c.sizes))

    return TensorSpec(fqn, shape, dtype, read)


def _skipped(fqn: str, entry: Any) -> bool:
    return not hasattr(entry, "chunks") or fqn.split(".", 1)[0] in SKIPPED_KEYS


def dcp_specs(path: Path) -> list[TensorSpec]:
    """The model tensors of the DCP checkpoint directory `path`, as consolidation specs."""
    meta = load_metadata(path / DCP_METADATA)
    entries = getattr(meta, "state_dict_metadata", None)
    if not isinstance(entries, dict) or not isinstance(getattr(meta, "storage_data", None), dict):
        raise CorruptFileError(f"{path / DCP_METADATA}: not a DCP Metadata record")
    files = _Files(path)
    # Bytes entries have no offset; tensors' chunks are keyed by (name, chunk offsets).
    by_key = {
        (i.fqn, tuple(int(x) for x in i.offset)): info
        for i, info in meta.storage_data.items()
        if i.offset is not None
    }
    specs: list[TensorSpec] = []
    saved_as: dict[str, str] = {}
    for fqn, entry in entries.items():
        if _skipped(fqn, entry):
            continue
        name = canonical_name(fqn)
        if name in saved_as:
            raise CheckpointError(
                f"{path}: {saved_as[name]!r} and {fqn!r} are both {name!r} once "
                "torch.compile's _orig_mod is dropped: consolidation cannot write both"
            )
        saved_as[name] = fqn
        shape = tuple(int(d) for d in entry.size)
        dtype = entry.properties.dtype
        chunks = _chunks(by_key, fqn, entry, files)
        make: Callable[..., TensorSpec] = _row_spec if _rows_only(shape, chunks) else _box_spec
        # Errors while reading name the tensor as saved; the spec writes it as `name`.
        specs.append(dataclasses.replace(make(fqn, shape, dtype, chunks), name=name))
    if not specs:
        raise CheckpointError(f"{path}: the DCP checkpoint holds no model tensors")
    return specs
