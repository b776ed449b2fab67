"""`load_safetensors`: full weights from Hugging Face safetensors, each rank reading its shard.

[Note: reading only this rank's bytes]
A safetensors file is an 8-byte little-endian header length, a JSON header (per tensor:
dtype, shape, [begin, end) byte offsets into the data that follows) and the raw
little-endian data, row-major. A flat group's slot piece on this rank is a contiguous run
of its parameter's flattened elements, hence a contiguous byte range of the file: we read
exactly that range (positioned reads, no seek-and-read-all) into the master shard,
in chunks so a huge piece never needs a second full-size host copy. A parameter split by
tensor parallelism holds a piece of the file's tensor: its elements are contiguous runs
of the tensor's (one per index before the split dim, `full_runs`), each read as above.
Every rank reads its
own pieces only; stages 1/2 then all-gather the compute-dtype parameters (`publish`),
stage 3 refreshes the compute shard. Buffers are small and read whole on every rank.

Everything is checked against the headers before the first byte of data is read, on
every rank alike, so bad input raises the same error everywhere instead of leaving some
ranks waiting in the all-gather.
"""

from __future__ import annotations

import json
import math
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from zeroshard.ckpt import (
    CheckpointError,
    pread_into,
    read_safetensors_header,
    safetensors_dtype,
    safetensors_dtype_code,
)
from zeroshard.comm import agreed, arrive
from zeroshard.engine.runtime._names import named_buffers, named_parameters
from zeroshard.engine.runtime._state import EngineModel, EngineState, engine_module, engine_state
from zeroshard.engine.runtime._tensor_parallel import full_runs, is_dtensor
from zeroshard.engine.state._checkpoint import every_rank

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
# Larger pieces are read and converted this many bytes at a time.
CHUNK_BYTES = 64 * 2**20


class SafetensorsLoadError(ValueError):
    """A safetensors file or index that cannot be loaded into this model."""


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of a safetensors file: absolute byte range [start, end) of its data."""

    name: str
    file: Path
    dtype: str
    shape: tuple[int, ...]
    start: int
    end: int

    @property
    def numel(self) -> int:
        """Elements of the tensor."""
        return math.prod(self.shape)

    @property
    def torch_dtype(self) -> torch.dtype:
        """The torch dtype of the stored data."""
        return safetensors_dtype(self.dtype)


@dataclass(frozen=True)
class LoadReport:
    """What `load_safetensors` read on this rank (bytes actually read, by kind)."""

    param_bytes: int
    buffer_bytes: int
    header_bytes: int
    pieces: int
    buffers: int
    unexpected: tuple[str, ...]

    @property
    def bytes_read(self) -> int:
        """Every byte this rank read from the files."""
        return self.param_bytes + self.buffer_bytes + self.header_bytes


def read_header(path: Path) -> tuple[dict[str, TensorEntry], int]:
    """Parse one safetensors file's header: its tensors, and the header's size in bytes."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError as e:
        raise SafetensorsLoadError(f"cannot read {path}: {e}") from e
    try:
        header = read_safetensors_header(fd, path)
    except CheckpointError as e:
        raise SafetensorsLoadError(str(e)) from e
    finally:
        os.close(fd)
    entries = {
        name: TensorEntry(
            name, path, safetensors_dtype_code(e.dtype), e.shape, e.offset, e.offset + e.nbytes
        )
        for name, e in header.entries.items()
    }
    return entries, header.data_start


def index_tensors(path: str | os.PathLike[str]) -> tuple[dict[str, TensorEntry], int]:
    """Every tensor of a .safetensors file or a directory (HF index, or model.safetensors)."""
    root = Path(path)
    if root.is_file():
        return read_header(root)
    if not root.is_dir():
        raise SafetensorsLoadError(f"{root} is neither a .safetensors file nor a directory")
    index = root / INDEX_NAME
    if not index.is_file():
        if (root / SINGLE_NAME).is_file():
            return read_header(root / SINGLE_NAME)
        raise SafetensorsLoadError(f"{root} holds neither {INDEX_NAME} nor {SINGLE_NAME}")
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise SafetensorsLoadError(f"{index}: no readable weight_map ({e!r})") from e
    if not isinstance(weight_map, dict):
        raise SafetensorsLoadError(f"{index}: weight_map is not an object")
    headers: dict[str, dict[str, TensorEntry]] = {}
    header_bytes = 0
    out: dict[str, TensorEntry] = {}
    for name, file in weight_map.items():
        if file not in headers:
            if not isinstance(file, str) or Path(file).name != file:
                raise SafetensorsLoadError(f"{index}: {name!r} maps to a bad file name {file!r}")
            headers[file], n = read_header(root / file)
            header_bytes += n
        entry = headers[file].get(name)
        if entry is None:
            raise SafetensorsLoadError(f"{index} puts {name!r} in {file}, which has no such tensor")
        out[name] = entry
    return out, header_bytes


class _RangeReader:
    """Positioned reads of exact byte ranges, counting every byte read."""

    def __init__(self) -> None:
        self._fds: dict[Path, int] = {}
        self.bytes_read = 0

    def _fd(self, path: Path) -> int:
        fd = self._fds.get(path)
        if fd is None:
            fd = self._fds[path] = os.open(path, os.O_RDONLY)
        return fd

    def chunks(
        self, entry: TensorEntry, first: int, numel: int
    ) -> Iterator[tuple[int, torch.Tensor]]:
        """Elements [first, first + numel) of `entry`, as (element offset, tensor) chunks."""
        itemsize = entry.torch_dtype.itemsize
        step = max(1, CHUNK_BYTES // itemsize)
        for lo in range(0, numel, step):
            n = min(step, numel - lo)
            buf = torch.empty(n, dtype=entry.torch_dtype)
            offset = entry.start + (first + lo) * itemsize
            try:
                pread_into(self._fd(entry.file), buf, offset, entry.file)
            except CheckpointError as e:
                raise SafetensorsLoadError(str(e)) from e
            self.bytes_read += n * itemsize
            yield lo, buf

    def close(self) -> None:
        """Close every file opened."""
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()


def _find(entries: dict[str, TensorEntry], aliases: list[str]) -> TensorEntry | None:
    for name in aliases:
        if name in entries:
            return entries[name]
    return None


@torch.no_grad()
def load_safetensors(model: EngineModel, path: str | os.PathLike[str]) -> LoadReport:
    """Load full weights into an initialized model; each rank reads only its shard's bytes.

    `path` is a .safetensors file or a directory with a Hugging Face index. Collective:
    call it on every rank (a rank calling it alone fails within seconds, naming it). A
    file that is missing, damaged or of another model on any rank is the same error on
    every rank, before any weight changes; a read that fails midway fails every rank
    too (load again). Optimizer state is left as it is: load before training. See
    [Note: reading only this rank's bytes].
    """
    if sys.byteorder != "little":
        raise SafetensorsLoadError("safetensors data is little-endian; this host is not")
    model = engine_module(model)
    state = engine_state(model)
    everyone = every_rank(state)
    arrive(everyone, "zs.load_safetensors", "Call it on every rank: each reads its own shard")
    # A delayed step in flight (delay_param_update) must not write over what is loaded.
    state.settle()
    label = f"load_safetensors({str(path)!r})"
    kinds = (SafetensorsLoadError, OSError)
    planned = agreed(everyone, label, lambda: _plan(model, state, path), kinds)
    report = agreed(everyone, f"{label}: reading", lambda: _read(state, planned), kinds)
    # Offloaded masters are recast and uploaded, stages 1/2 all-gather the parameters and
    # stage 3 drops gathered units, whose buffers now hold the old weights.
    state.republish()
    return report


@dataclass(frozen=True)
class _Planned:
    """What `_plan` found in the file for each parameter and buffer, checked."""

    plan: dict[str, TensorEntry]
    buffers: list[tuple[torch.Tensor, TensorEntry]]
    header_bytes: int
    unexpected: tuple[str, ...]


def _plan(model: torch.nn.Module, state: EngineState, path: str | os.PathLike[str]) -> _Planned:
    """Every slot of every group checked against the file (not only this rank's: all
    ranks then agree); SafetensorsLoadError listing what does not fit."""
    entries, header_bytes = index_tensors(path)
    aliases: dict[int, list[str]] = {}
    for name, p in named_parameters(model, remove_duplicate=False):
        aliases.setdefault(id(p), []).append(name)
    buffer_names: dict[int, list[str]] = {}
    buffers: dict[int, torch.Tensor] = {}
    for name, b in named_buffers(model, remove_duplicate=False):
        buffer_names.setdefault(id(b), []).append(name)
        buffers[id(b)] = b

    plan: dict[str, TensorEntry] = {}
    missing: list[str] = []
    problems: list[str] = []
    for g in state.groups:
        for p, slot in zip(g.params, g.layout.slots, strict=True):
            entry = _find(entries, aliases.get(id(p), [slot.name]))
            # A DTensor parameter's slot holds its piece of the full tensor in the file.
            shape = tuple(p.shape) if is_dtensor(p) else slot.shape
            if entry is None:
                missing.append(slot.name)
            elif entry.shape != shape:
                problems.append(
                    f"{slot.name}: the file has {entry.name!r} of shape {list(entry.shape)}, "
                    f"the model's is {list(shape)}"
                )
            elif not entry.torch_dtype.is_floating_point:
                problems.append(f"{slot.name}: dtype {entry.dtype} is not floating point")
            else:
                plan[slot.name] = entry
    found_buffers: list[tuple[torch.Tensor, TensorEntry]] = []
    for key, b in buffers.items():
        entry = _find(entries, buffer_names[key])
        if entry is None:
            continue
        if entry.shape != tuple(b.shape):
            problems.append(
                f"buffer {buffer_names[key][0]}: the file has shape {list(entry.shape)}, "
                f"the model's is {list(b.shape)}"
            )
        found_buffers.append((b, entry))
    if missing:
        problems.insert(0, f"{len(missing)} parameter(s) missing from {path}: {sorted(missing)}")
    if problems:
        raise SafetensorsLoadError("cannot load safetensors:\n  " + "\n  ".join(problems))
    # A tied weight stored under several of its names is loaded once, yet expected.
    known = {n for names in (*aliases.values(), *buffer_names.values()) for n in names}
    return _Planned(plan, found_buffers, header_bytes, tuple(sorted(set(entries) - known)))


def _read(state: EngineState, planned: _Planned) -> LoadReport:
    """Copy this rank's ranges of the planned tensors into its masters and the buffers."""
    plan = planned.plan
    reader = _RangeReader()
    pieces = 0
    try:
        for g in state.groups:
            master = g.master.detach()
            params = dict(zip(g.names, g.params, strict=True))
            for slot, piece in g.layout.slots_in_shard(g.process_group.rank):
                runs = full_runs(params[slot.name], slot.shape, piece.slot_start, piece.numel)
                for start, local, numel in runs:
                    for lo, chunk in reader.chunks(plan[slot.name], start, numel):
                        at = piece.shard_start + local - piece.slot_start + lo
                        # From pageable host memory copy_ returns once the bytes are
                        # staged, so the chunk's buffer may be dropped right after, even
                        # on CUDA.
                        master[at : at + chunk.numel()].copy_(chunk)
                pieces += 1
        param_bytes = reader.bytes_read
        for b, entry in planned.buffers:
            parts = [chunk for _, chunk in reader.chunks(entry, 0, entry.numel)]
            if parts:
                b.copy_(torch.cat(parts).view(b.shape))  # casts to the buffer's own dtype
    finally:
        reader.close()
    return LoadReport(
        param_bytes=param_bytes,
        buffer_bytes=reader.bytes_read - param_bytes,
        header_bytes=planned.header_bytes,
        pieces=pieces,
        buffers=len(planned.buffers),
        unexpected=planned.unexpected,
    )
