"""Pickle-safe reading of a PyTorch DCP directory's pieces: `.metadata` and tensor chunks.

[Note: DCP on disk]
`torch.distributed.checkpoint` (`dcp.save`, FSDP2, torchtitan) writes a `.metadata`
pickle (per tensor: dtype, global shape, and the chunks, as n-d boxes, that ranks saved;
per chunk: which `.distcp` file holds it, at which byte offset and length) and one or
more `.distcp` files, each a concatenation of `torch.save` archives, one per chunk.
A `torch.save` archive is an uncompressed zip whose `data.pkl` says which storage the
tensor views (and at which element offset, with which strides) and whose
`data/<key>` entry holds that storage's raw little-endian bytes. So once both pickles
are read, a chunk's elements are a plain byte range of its `.distcp` file, read with
positioned reads straight into the output buffer, a piece at a time.

torch's own reader unpickles `.metadata` with plain `pickle.load`, which would run any
code a crafted file asks for; both pickles are read here with unpicklers that build
only the few torch classes and functions they need and refuse every other global.
"""

from __future__ import annotations

import io
import os
import pickle
import struct
import zipfile
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from zeroshard.ckpt._errors import CheckpointError
from zeroshard.ckpt.foreign._unpickle import CorruptFileError, UnsafePickleError

_METADATA_GLOBALS = {
    ("torch.distributed.checkpoint.metadata", name)
    for name in (
        "Metadata",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "TensorProperties",
        "ChunkStorageMetadata",
        "MetadataIndex",
        "StorageMeta",
        "_MEM_FORMAT_ENCODING",
    )
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("collections", "OrderedDict"),
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
}
_DTYPE_NAMES = {
    str(d).removeprefix("torch."): d
    for d in (
        torch.float64,
        torch.float32,
        torch.float16,
        torch.bfloat16,
        torch.int64,
        torch.int32,
        torch.int16,
        torch.int8,
        torch.uint8,
        torch.bool,
    )
}
# torch.save names a storage by its legacy typed class: FloatStorage holds float32.
_STORAGE_DTYPES = {
    "DoubleStorage": torch.float64,
    "FloatStorage": torch.float32,
    "HalfStorage": torch.float16,
    "BFloat16Storage": torch.bfloat16,
    "LongStorage": torch.int64,
    "IntStorage": torch.int32,
    "ShortStorage": torch.int16,
    "CharStorage": torch.int8,
    "ByteStorage": torch.uint8,
    "BoolStorage": torch.bool,
}


def _refused(path: Path, global_name: str) -> UnsafePickleError:
    detail = f"it asks for the global {global_name!r}, which DCP checkpoints do not need"
    error = UnsafePickleError(path, None, detail)
    error.global_name = global_name
    return error


class _MetadataUnpickler(pickle.Unpickler):
    def __init__(self, file: io.BufferedIOBase, path: Path) -> None:
        super().__init__(file)
        self._path = path

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _METADATA_GLOBALS or (module == "torch" and name in _DTYPE_NAMES):
            return super().find_class(module, name)
        raise _refused(self._path, f"{module}.{name}")

    def persistent_load(self, pid: Any) -> Any:
        raise UnsafePickleError(self._path, None, "a DCP .metadata holds no persistent ids")


def load_metadata(path: Path) -> Any:
    """Unpickle a DCP `.metadata` file, refusing any global but DCP's own records."""
    try:
        with open(path, "rb") as f:
            return _MetadataUnpickler(f, path).load()
    except (UnsafePickleError, OSError):
        raise
    except Exception as e:  # a truncated or foreign pickle fails in many ways
        raise CorruptFileError(f"{path}: not a readable DCP .metadata pickle ({e!r})") from e


@dataclass(frozen=True)
class ChunkBytes:
    """Where a saved chunk's elements lie: `numel` elements of `dtype` from byte `offset`."""

    offset: int
    dtype: torch.dtype
    numel: int


@dataclass(frozen=True)
class _StorageRef:
    key: str
    dtype: torch.dtype
    numel: int


@dataclass(frozen=True)
class _TensorRef:
    storage: _StorageRef
    storage_offset: int
    size: tuple[int, ...]
    stride: tuple[int, ...]


def _rebuild_tensor_v2(storage: Any, offset: Any, size: Any, stride: Any, *_: Any) -> _TensorRef:
    return _TensorRef(storage, int(offset), tuple(size), tuple(stride))


class _StorageType:
    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype


class _ChunkUnpickler(pickle.Unpickler):
    """Reads a chunk archive's `data.pkl` into a `_TensorRef`, loading no data."""

    def __init__(self, file: io.BytesIO, where: str) -> None:
        super().__init__(file)
        self._where = where

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
            return _rebuild_tensor_v2
        if (module, name) == ("collections", "OrderedDict"):
            return OrderedDict
        if module == "torch" and name in _STORAGE_DTYPES:
            return _StorageType(_STORAGE_DTYPES[name])
        raise _refused(Path(self._where), f"{module}.{name}")

    def persistent_load(self, pid: Any) -> Any:
        if (
            not isinstance(pid, tuple)
            or len(pid) != 5
            or pid[0] != "storage"
            or not isinstance(pid[1], _StorageType)
        ):
            raise CorruptFileError(f"{self._where}: unexpected storage record {pid!r}")
        return _StorageRef(str(pid[2]), pid[1].dtype, int(pid[4]))


class _Window(io.RawIOBase):
    """Bytes [start, start + length) of an open file, as a seekable read-only stream."""

    def __init__(self, fd: int, start: int, length: int) -> None:
        super().__init__()
        self._fd, self._start, self._length, self._pos = fd, start, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._length}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        n = max(0, min(len(view), self._length - self._pos))
        data = os.pread(self._fd, n, self._start + self._pos) if n else b""
        view[: len(data)] = data
        self._pos += len(data)
        return len(data)


def _contiguous_strides(size: tuple[int, ...]) -> tuple[int, ...]:
    strides, step = [], 1
    for d in reversed(size):
        strides.append(step)
        step *= max(d, 1)
    return tuple(reversed(strides))


def locate_chunk(fd: int, path: Path, offset: int, length: int, fqn: str) -> ChunkBytes:
    """Find the raw bytes of the chunk saved at [offset, offset + length) of `path`."""
    where = f"{path} (bytes {offset}..{offset + length}, tensor {fqn!r})"
    size = os.fstat(fd).st_size
    if offset < 0 or length <= 0 or offset + length > size:
        raise CorruptFileError(
            f"{where}: the .metadata places a chunk past the file's end ({size} bytes): "
            "truncated or half-written"
        )
    window = _Window(fd, offset, length)
    try:
        with zipfile.ZipFile(io.BufferedReader(window)) as zf:
            infos = {i.filename: i for i in zf.infolist()}
            pkl = next((n for n in infos if n.endswith("/data.pkl") or n == "data.pkl"), None)
            if pkl is None:
                raise CorruptFileError(f"{where}: no data.pkl: not a torch.save archive")
            prefix = pkl[: -len("data.pkl")]
            ref = _ChunkUnpickler(io.BytesIO(zf.read(pkl)), where).load()
            if not isinstance(ref, _TensorRef):
                raise CorruptFileError(f"{where}: the archive holds no tensor")
            info = infos.get(f"{prefix}data/{ref.storage.key}")
    except (zipfile.BadZipFile, EOFError, struct.error) as e:
        raise CorruptFileError(f"{where}: not a torch.save archive ({e})") from e
    except pickle.UnpicklingError as e:
        raise CorruptFileError(f"{where}: unreadable data.pkl ({e})") from e
    itemsize = ref.storage.dtype.itemsize
    if info is None or info.compress_type != zipfile.ZIP_STORED:
        raise CorruptFileError(f"{where}: the tensor's storage is missing or compressed")
    if info.file_size != ref.storage.numel * itemsize:
        raise CorruptFileError(
            f"{where}: storage holds {info.file_size} bytes, expected {ref.storage.numel} "
            f"elements of {ref.storage.dtype}"
        )
    numel = 1
    for d in ref.size:
        numel *= d
    if numel and ref.stride != _contiguous_strides(ref.size):
        raise CheckpointError(f"{where}: a non-contiguous chunk (strides {ref.stride})")
    if ref.storage_offset + numel > ref.storage.numel:
        raise CorruptFileError(f"{where}: the tensor reaches past its storage")
    head = os.pread(fd, 30, offset + info.header_offset)
    if len(head) < 30 or head[:4] != b"PK\x03\x04":
        raise CorruptFileError(f"{where}: bad zip entry header for the storage")
    name_len, extra_len = struct.unpack("<HH", head[26:30])
    data = offset + info.header_offset + 30 + name_len + extra_len
    start = data + ref.storage_offset * itemsize
    if start + numel * itemsize > offset + length:
        raise CorruptFileError(f"{where}: the storage reaches past the chunk's bytes")
    return ChunkBytes(start, ref.storage.dtype, numel)
