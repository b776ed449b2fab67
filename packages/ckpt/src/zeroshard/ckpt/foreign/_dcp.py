"""PyTorch DCP checkpoints (FSDP2, torchtitan, `dcp.save`) as `TensorSpec`s for consolidation.

Every tensor entry of the `.metadata` becomes one spec of its global shape and saved
dtype, read from the chunks the ranks saved (see [Note: DCP on disk] in `_dcp_pickle`);
the output equals torch's `dcp_to_torch_save`, bit for bit. Optimizer state (entries
under a top-level `optimizer` or `optim` key, as torchtitan and the DCP tutorials save
it) and non-tensor entries (bytes: a step counter, a dataloader's state) are skipped. Names
drop torch.compile's `_orig_mod` segments (a `model.state_dict()` of a compiled model
saved as it is), as everything zeroshard writes does (see `_names`).

Every spec is a `RangeSpec`, read piecewise by positioned reads, so the writer's memory
bound holds. Chunks that split a tensor along its first dimension only (FSDP2's even
sharding, and any replicated tensor) are contiguous runs of the flat tensor; other
chunkings (tensor parallel splits of later dimensions) are read a few whole rows at a
time, each chunk's part of those rows being contiguous in its file.

`DcpCheckpoint` is the directory's index: its tensor entries as specs by saved name and
its non-tensor entries (hyperparameters, counters) unpickled one at a time on request,
by torch's weights-only unpickler.
"""

from __future__ import annotations

import dataclasses
import math
import os
import weakref
from collections.abc import Sequence
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
from zeroshard.ckpt.foreign._unpickle import CorruptFileError, load_torch_bytes

DCP_METADATA = ".metadata"
SKIPPED_KEYS = ("optimizer", "optim")


def has_dcp_metadata(path: Path) -> bool:
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
    """Elements [first, first + out.numel()) of `chunk` into contiguous CPU `out` (cast to
    its dtype if that is not the saved one: a resume into bf16 or fp32 masters)."""
    offset = chunk.data.offset + first * chunk.data.dtype.itemsize
    if out.dtype == chunk.data.dtype:
        pread_into(chunk.fd, out, offset, chunk.path, CorruptFileError)
        return
    saved = torch.empty(out.numel(), dtype=chunk.data.dtype)
    pread_into(chunk.fd, saved, offset, chunk.path, CorruptFileError)
    out.copy_(saved)


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
) -> RangeSpec:
    for c in chunks:
        if len(c.offsets) != len(shape) or any(
            o < 0 or o + s > d for o, s, d in zip(c.offsets, c.sizes, shape, strict=True)
        ):
            raise CorruptFileError(f"{c.path}: chunk {list(c.offsets)} lies outside {fqn!r}")
    if sum(c.data.numel for c in chunks) != math.prod(shape):
        raise CorruptFileError(f"the chunks of {fqn!r} do not cover its {list(shape)} exactly")
    row = math.prod(shape[1:])

    def read_range(start: int, out: torch.Tensor) -> None:
        # The whole rows [lo, hi) holding the range, each chunk's part of them read at once
        # (a chunk's rows are contiguous in its file), then the range cut out of them.
        if out.numel() == 0:
            return
        end = start + out.numel()
        lo, hi = start // row, -(-end // row)
        rows = torch.empty((hi - lo, *shape[1:]), dtype=dtype)
        for c in chunks:
            a, b = max(lo, c.offsets[0]), min(hi, c.offsets[0] + c.sizes[0])
            if a >= b:
                continue
            chunk_row = math.prod(c.sizes[1:])
            part = torch.empty((b - a) * chunk_row, dtype=dtype)
            _read_chunk(c, part, (a - c.offsets[0]) * chunk_row)
            cols = [slice(o, o + s) for o, s in zip(c.offsets[1:], c.sizes[1:], strict=True)]
            box = (slice(a - lo, b - lo), *cols)
            rows[box].copy_(part.view(b - a, *c.sizes[1:]))
        out.copy_(rows.view(-1)[start - lo * row : end - lo * row])

    def read(out: torch.Tensor) -> None:
        read_range(0, out)

    return RangeSpec(fqn, shape, dtype, read, read_range)


class DcpCheckpoint:
    """A DCP checkpoint directory, indexed from its `.metadata` (nothing else is read yet).

    `tensors` maps each saved tensor name to its global shape and dtype; `spec(name)`
    reads one, `value(name)` unpickles one non-tensor entry (`values` lists them; both
    in the order they were saved).
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        meta = load_metadata(path / DCP_METADATA)
        entries = getattr(meta, "state_dict_metadata", None)
        storage = getattr(meta, "storage_data", None)
        if not isinstance(entries, dict) or not isinstance(storage, dict):
            raise CorruptFileError(f"{path / DCP_METADATA}: not a DCP Metadata record")
        self._files = _Files(path)
        self._entries = entries
        # Tensors' chunks are keyed by (name, chunk offsets); non-tensor entries by name.
        self._chunks = {
            (i.fqn, tuple(int(x) for x in i.offset)): info
            for i, info in storage.items()
            if i.offset is not None
        }
        self._values = {i.fqn: info for i, info in storage.items() if i.offset is None}
        self.tensors: dict[str, tuple[tuple[int, ...], torch.dtype]] = {
            fqn: (tuple(int(d) for d in e.size), e.properties.dtype)
            for fqn, e in entries.items()
            if hasattr(e, "chunks")
        }
        self.values = tuple(fqn for fqn, e in entries.items() if not hasattr(e, "chunks"))

    @property
    def ranks(self) -> int:
        """How many ranks wrote it (their files are `__{rank}_{n}.distcp`; 0 if unnamed so)."""
        names = {str(info.relative_path) for info in self._chunks.values()}
        return len({n.split("_")[2] for n in names if n.startswith("__") and n.count("_") >= 3})

    def spec(self, fqn: str) -> RangeSpec:
        """The saved tensor `fqn`, read piecewise from its chunks."""
        shape, dtype = self.tensors[fqn]
        chunks = _chunks(self._chunks, fqn, self._entries[fqn], self._files)
        make = _row_spec if _rows_only(shape, chunks) else _box_spec
        return make(fqn, shape, dtype, chunks)

    def value(self, fqn: str) -> Any:
        """The non-tensor entry `fqn` (a number, a tuple...), unpickled weights-only."""
        info = self._values.get(fqn)
        if info is None:
            raise CorruptFileError(f"{self.path / DCP_METADATA}: {fqn!r} has no storage")
        fd = self._files.fd(info.relative_path, fqn)
        path = self.path / info.relative_path
        offset, length = int(info.offset), int(info.length)
        raw = os.pread(fd, length, offset)
        if len(raw) != length:
            raise CorruptFileError(
                f"{path}: {fqn!r} lies at bytes {offset}..{offset + length}, past the file's "
                "end: truncated or half-written"
            )
        return load_torch_bytes(raw, f"{path} (entry {fqn!r})")


def _skipped(fqn: str) -> bool:
    return fqn.split(".", 1)[0] in SKIPPED_KEYS


def dcp_specs(path: Path) -> list[TensorSpec]:
    """The model tensors of the DCP checkpoint directory `path`, as consolidation specs."""
    ckpt = DcpCheckpoint(path)
    specs: list[TensorSpec] = []
    saved_as: dict[str, str] = {}
    for fqn in ckpt.tensors:
        if _skipped(fqn):
            continue
        name = canonical_name(fqn)
        if name in saved_as:
            raise CheckpointError(
                f"{path}: {saved_as[name]!r} and {fqn!r} are both {name!r} once "
                "torch.compile's _orig_mod is dropped: consolidation cannot write both"
            )
        saved_as[name] = fqn
        # Errors while reading name the tensor as saved; the spec writes it as `name`.
        specs.append(dataclasses.replace(ckpt.spec(fqn), name=name))
    if not specs:
        raise CheckpointError(f"{path}: the DCP checkpoint holds no model tensors")
    return specs
