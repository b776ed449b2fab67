"""Safetensors files at the byte level: plan a header, write tensors, pread ranges, checksum.

We write the format ourselves (an 8-byte little-endian header length, a JSON header
padded with spaces to a multiple of 8, then the raw little-endian data) so that a
file's checksum is computed while it is written, and so that readers can `pread`
exactly the bytes they need straight into a destination tensor. Files are read back
by the `safetensors` library in the tests.
"""

from __future__ import annotations

import ctypes
import json
import os
import struct
import sys
import zlib
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import cast

import torch

from zeroshard.ckpt._errors import CheckpointError
from zeroshard.ckpt._group_meta import FileMeta
from zeroshard.ckpt._keys import CHECKSUM_ALGORITHM

_CODES: dict[torch.dtype, str] = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}
for _attr, _code in (("float8_e4m3fn", "F8_E4M3"), ("float8_e5m2", "F8_E5M2")):
    if hasattr(torch, _attr):
        _CODES[getattr(torch, _attr)] = _code
_DTYPES = {code: dtype for dtype, code in _CODES.items()}

_IO_CHUNK = 16 * 1024 * 1024
# The largest JSON header the safetensors library reads (its MAX_HEADER_SIZE): the
# writer refuses a bigger one before writing and the reader accepts up to it, so every
# file written reads back, with this reader and with the library.
MAX_HEADER_BYTES = 100_000_000
_MAX_READ = 1 << 30


def st_code(dtype: torch.dtype) -> str:
    """The safetensors dtype code of a torch dtype ('F32', 'BF16', ...)."""
    try:
        return _CODES[dtype]
    except KeyError:
        raise CheckpointError(f"dtype {dtype} cannot be stored in safetensors") from None


def st_dtype(code: str) -> torch.dtype:
    """The torch dtype of a safetensors dtype code ('F32' -> torch.float32)."""
    try:
        return _DTYPES[code]
    except KeyError:
        raise CheckpointError(f"unsupported safetensors dtype {code!r}") from None


@dataclass(frozen=True)
class Entry:
    """One tensor in a safetensors file: dtype, shape and absolute byte offset in the file."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int
    nbytes: int

    @property
    def numel(self) -> int:
        """Number of elements."""
        n = 1
        for d in self.shape:
            n *= d
        return n


@dataclass(frozen=True)
class Header:
    """A parsed (or planned) safetensors header."""

    entries: dict[str, Entry]
    metadata: dict[str, str]
    data_start: int
    size: int


def plan_header(
    items: Iterable[tuple[str, torch.dtype, tuple[int, ...]]],
    metadata: Mapping[str, str] | None = None,
) -> tuple[bytes, Header]:
    """Header bytes (length prefix included) and the entries, tensors laid out in order."""
    fields: dict[str, object] = {}
    if metadata:
        fields["__metadata__"] = dict(metadata)
    layout: list[tuple[str, torch.dtype, tuple[int, ...], int, int]] = []
    pos = 0
    for name, dtype, shape in items:
        n = 1
        for d in shape:
            n *= d
        nbytes = n * dtype.itemsize
        fields[name] = {
            "dtype": st_code(dtype),
            "shape": list(shape),
            "data_offsets": [pos, pos + nbytes],
        }
        layout.append((name, dtype, shape, pos, nbytes))
        pos += nbytes
    text = json.dumps(fields, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    data_start = 8 + len(text)
    entries = {n: Entry(d, s, data_start + p, b) for n, d, s, p, b in layout}
    header = Header(entries, dict(metadata or {}), data_start, data_start + pos)
    return struct.pack("<Q", len(text)) + text, header


def check_header_fits(
    tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str] | None, what: str
) -> None:
    """CheckpointError if the header of a file of `tensors` and `metadata` would be
    bigger than a safetensors header may be (MAX_HEADER_BYTES)."""
    head, _ = plan_header(
        ((k, t.dtype, tuple(t.shape)) for k, t in tensors.items()), metadata or {"format": "pt"}
    )
    if len(head) - 8 > MAX_HEADER_BYTES:
        extra = sum(len(v) for v in (metadata or {}).values())
        raise CheckpointError(
            f"{what} would have a {len(head) - 8:,}-byte safetensors header ({extra:,} "
            f"bytes of it the JSON of the state kept beside the shards), over the "
            f"{MAX_HEADER_BYTES:,} a safetensors header may hold: keep big arrays in "
            "tensors, not in lists of numbers"
        )


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """A byte view of a contiguous CPU tensor's memory; the caller keeps `t` alive."""
    if not t.is_contiguous() or t.device.type != "cpu":
        raise ValueError("tensor_bytes needs a contiguous CPU tensor")
    n = t.numel() * t.element_size()
    if n == 0:
        return memoryview(b"")
    return memoryview((ctypes.c_ubyte * n).from_address(t.data_ptr())).cast("B")


def pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    """Write all of `data` at `offset` (os.pwrite may write less than asked)."""
    done = 0
    while done < len(data):
        done += os.pwrite(fd, data[done:], offset + done)


def pread_into(
    fd: int,
    out: torch.Tensor,
    offset: int,
    path: Path | str,
    error: type[CheckpointError] = CheckpointError,
) -> None:
    """Fill contiguous CPU tensor `out` with the bytes at `offset`; `error` on a short file."""
    view = tensor_bytes(out)
    done = 0
    while done < len(view):
        # preadv is capped per call (Linux: 0x7ffff000 bytes); ask for at most _MAX_READ.
        n = os.preadv(fd, [view[done : done + _MAX_READ]], offset + done)
        if n == 0:
            raise error(
                f"{path}: ends at byte {offset + done}, expected data up to byte "
                f"{offset + len(view)} (truncated file?)"
            )
        done += n


def fsync_dir(path: Path) -> None:
    """fsync a directory so that renames and new entries in it are durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_file(
    path: Path, tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str] | None = None
) -> FileMeta:
    """Write tensors (in the mapping's order) as one safetensors file; fsync; size + checksum."""
    head, plan = plan_header(
        ((k, t.dtype, tuple(t.shape)) for k, t in tensors.items()), metadata or {"format": "pt"}
    )
    crc = zlib.crc32(head)
    with open(path, "wb") as f:
        f.write(head)
        for t in tensors.values():
            # One tensor at a time on the host: a CUDA shard is copied down just before
            # its bytes are written, so host memory holds at most one shard extra.
            host = t.detach().to("cpu").contiguous()
            view = tensor_bytes(host)
            for i in range(0, len(view), _IO_CHUNK):
                part = view[i : i + _IO_CHUNK]
                crc = zlib.crc32(part, crc)
                f.write(part)
            del view, host
        f.flush()
        os.fsync(f.fileno())
    return FileMeta(plan.size, f"{crc:08x}")


def read_header(fd: int, path: Path | str) -> Header:
    """Parse and check a safetensors header; CheckpointError naming the file (and the
    tensor) when it is not one, or when a tensor's bytes do not fit inside the file."""
    size = os.fstat(fd).st_size
    raw = os.pread(fd, 8, 0)
    if len(raw) < 8:
        raise CheckpointError(f"{path}: {size} bytes, too short for a safetensors file")
    (n,) = struct.unpack("<Q", raw)
    if n > MAX_HEADER_BYTES or 8 + n > size:
        raise CheckpointError(f"{path}: bad safetensors header length {n} (file has {size} bytes)")
    try:
        fields = json.loads(os.pread(fd, n, 8))
    except (UnicodeDecodeError, ValueError) as e:
        raise CheckpointError(f"{path}: the safetensors header is not valid JSON ({e})") from e
    if not isinstance(fields, dict):
        raise CheckpointError(f"{path}: the safetensors header is not a JSON object")
    raw_meta = fields.pop("__metadata__", None) or {}
    if not isinstance(raw_meta, dict):
        raise CheckpointError(f"{path}: __metadata__ is not a JSON object")
    metadata = {str(k): str(v) for k, v in raw_meta.items()}
    base = 8 + n
    entries = {name: _entry(path, name, f, base, size) for name, f in fields.items()}
    end = max((e.offset + e.nbytes for e in entries.values()), default=base)
    return Header(entries, metadata, base, end)


def _entry(path: Path | str, name: str, info: object, base: int, size: int) -> Entry:
    where = f"{path}: tensor {name!r}"
    if not isinstance(info, dict) or not {"dtype", "shape", "data_offsets"} <= info.keys():
        raise CheckpointError(f"{where}: needs dtype, shape and data_offsets")
    code, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
    if code not in _DTYPES:
        raise CheckpointError(f"{where}: unsupported dtype {code!r}; supported: {sorted(_DTYPES)}")
    if not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape):
        raise CheckpointError(f"{where}: bad shape {shape!r}")
    pair = isinstance(offsets, list) and len(offsets) == 2
    if not pair or not all(isinstance(o, int) for o in offsets):
        raise CheckpointError(f"{where}: bad data_offsets {offsets!r}")
    dtype = _DTYPES[code]
    entry = Entry(dtype, tuple(shape), base + offsets[0], offsets[1] - offsets[0])
    expected = entry.numel * dtype.itemsize
    if not base <= entry.offset <= entry.offset + entry.nbytes <= size or entry.nbytes != expected:
        raise CheckpointError(
            f"{where}: data_offsets {offsets} do not hold {expected} bytes of "
            f"{code}{shape} inside the file ({size} bytes): truncated or corrupt"
        )
    return entry


def file_digest(path: Path, algorithm: str = CHECKSUM_ALGORITHM) -> FileMeta:
    """Size and checksum of a whole file (crc32 here: fast, and catches flips and cuts)."""
    if algorithm != CHECKSUM_ALGORITHM:
        raise CheckpointError(f"{path}: unknown checksum algorithm {algorithm!r}")
    crc = 0
    size = 0
    buf = bytearray(_IO_CHUNK)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            crc = zlib.crc32(view[:n], crc)
            size += n
    return FileMeta(size, f"{crc:08x}", algorithm)


SYNC_FILE_RANGE_WRITE = 2  # linux/fs.h: start write-out of dirty pages, do not wait


def _load_sync_file_range() -> Callable[[int, int, int, int], int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (AttributeError, OSError):  # a libc without it
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return cast("Callable[[int, int, int, int], int]", fn)


_sync_file_range = _load_sync_file_range()


def start_writeback(fd: int, offset: int, nbytes: int) -> bool:
    """Ask the kernel to start writing bytes [offset, offset + nbytes) of `fd` to disk now,
    without waiting (Linux `sync_file_range`); False where that is not available.

    Only a head start for the final fsync, which still gives durability and reports any
    I/O error, so a failure here is ignored (ctypes drops the GIL for the call).
    """
    if _sync_file_range is None or nbytes <= 0:
        return False
    return _sync_file_range(fd, offset, nbytes, SYNC_FILE_RANGE_WRITE) == 0
