"""One rank's snapshot as bytes: what `save_checkpoint` writes for the rank (the same
metadata, tensors and user state), laid out for a copy into memory, with a checksum.

[Note: the snapshot file]
8 bytes, the header's length n (little-endian); n bytes of JSON: the step, the rank, the
world size, the checkpoint metadata's own JSON (`CheckpointMeta.to_json`; none in a
journal entry, which has its `journal` record instead: [Note: the gradient journal]),
the user state's (`RankExtra.text`) and each tensor's key, dtype, shape and offset,
padded with spaces (so that the file fills its slot: [Note: slots]); then the
tensors' bytes, each at a multiple of 64; then a 24-byte trailer: `zsnap001`, the
payload's length, its checksum and which checksum that is (4 bytes, little-endian):
1, crc32c (in hardware, several times zlib's speed: the host checksums every byte a
step copies), or 0, zlib's crc32 (the checkpoints'), as files written before crc32c
hold in what were 4 zero bytes of padding. Bytes whose trailer is missing, names a
checksum this version does not know, or whose checksum differs are no snapshot (a
killed write, a newer writer, a flipped bit): `check` raises `ChecksumError`, as a
damaged checkpoint file does.
"""

from __future__ import annotations

import json
import mmap
import os
import struct
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import torch

from zeroshard.ckpt import (
    CheckpointError,
    CheckpointMeta,
    ChecksumError,
    RankExtra,
    safetensors_dtype,
    safetensors_dtype_code,
)
from zeroshard.engine.recovery._crc import CRC32, CRC32C, Checksum, checksum

_MAGIC = b"zsnap001"
_TRAILER = struct.Struct("<8sQII")
CHECKSUM = CRC32C  # the checksum `seal` writes
# By the code the trailer's last field holds ([Note: the snapshot file]).
_CHECKSUMS = (CRC32, CRC32C)
_ALIGN = 64
# A header's room to grow in its slot (the hyperparameters a scheduler changes, printed
# longer; the user's state), and the most padding a slot's size may add to a snapshot
# (a state that shrank gets a smaller slot).
_SPARE = 1024
_SLACK = 1 << 20
_EXTRA = "extra."


class Planned(NamedTuple):
    """Where everything goes in a snapshot of `size` bytes (trailer included)."""

    header: bytes
    entries: Mapping[str, tuple[torch.dtype, tuple[int, ...], int]]
    size: int
    doc: Mapping[str, Any]  # the header's JSON document, before it is padded


@dataclass(frozen=True)
class Snapshot:
    """A parsed snapshot: its tensors are views of the bytes it was parsed from."""

    step: int
    rank: int
    world_size: int
    meta: CheckpointMeta | None  # None: a journal entry
    tensors: Mapping[str, torch.Tensor]
    extra: RankExtra | None
    journal: Mapping[str, Any] | None = None  # a journal entry's record


def file_tensors(
    tensors: Mapping[str, torch.Tensor], extra: RankExtra | None
) -> dict[str, torch.Tensor]:
    """Every tensor a snapshot holds, by its key there: `tensors` and the extra's."""
    out = dict(tensors)
    if extra is not None:
        out.update({_EXTRA + k: v for k, v in extra.tensors.items()})
    return out


def plan(
    step: int,
    rank: int,
    world_size: int,
    meta: CheckpointMeta | None,
    items: Mapping[str, torch.Tensor],
    extra_text: str | None,
    journal: Mapping[str, Any] | None = None,
    pad: int = _ALIGN,
    room: int | None = None,
) -> Planned:
    """The layout of a snapshot of `items` (`file_tensors`): see [Note: the snapshot file].
    The header is padded so that the size stays the same from step to step and the slot
    is reused ([Note: slots]): to `room` bytes in all (the slot's size) where they hold the
    snapshot with at most `_SLACK` to spare, else with `_SPARE` bytes to grow into and to a
    multiple of `pad` (a journal's: 64 KiB)."""
    entries: dict[str, tuple[torch.dtype, tuple[int, ...], int]] = {}
    at = 0
    for key, t in items.items():
        entries[key] = (t.dtype, tuple(t.shape), at)
        at += -(-t.numel() * t.element_size() // _ALIGN) * _ALIGN
    doc = {
        "step": step,
        "rank": rank,
        "world_size": world_size,
        "meta": None if meta is None else meta.to_json(),
        "journal": journal,
        "extra": extra_text,
        "tensors": {k: [safetensors_dtype_code(d), list(s), o] for k, (d, s, o) in entries.items()},
    }
    text = _text(doc)
    least = 8 + len(text) + at + _TRAILER.size
    least += -(8 + len(text)) % _ALIGN  # the tensors' alignment
    aligned = room is not None and (room - at - _TRAILER.size) % _ALIGN == 0
    if room is not None and aligned and least <= room <= least + _SLACK:
        text += b" " * (room - 8 - at - _TRAILER.size - len(text))
    else:
        text += b" " * _SPARE
        text += b" " * (-(8 + len(text)) % pad)
    head = struct.pack("<Q", len(text)) + text
    shifted = {k: (d, s, o + len(head)) for k, (d, s, o) in entries.items()}
    return Planned(head, shifted, len(head) + at + _TRAILER.size, doc)


def _text(doc: Mapping[str, Any]) -> bytes:
    return json.dumps(doc, separators=(",", ":")).encode()


def resolved(
    planned: Planned, meta: CheckpointMeta | None, journal: Mapping[str, Any] | None
) -> Planned:
    """`planned` with `meta` and `journal` in its header for those it was planned with,
    padded to the same length (their deferred scalars' values: [Note: scalars without a
    sync] in _scalars.py); ValueError if they do not fit."""
    doc = dict(planned.doc)
    doc["meta"] = None if meta is None else meta.to_json()
    doc["journal"] = journal
    text = _text(doc)
    room = len(planned.header) - 8
    if len(text) > room:
        raise ValueError(f"a snapshot's header grew to {len(text)} bytes, {room} were planned")
    head = planned.header[:8] + text + b" " * (room - len(text))
    return planned._replace(header=head, doc=doc)


def _view(buf: torch.Tensor, dtype: torch.dtype, shape: tuple[int, ...], at: int) -> torch.Tensor:
    n = 1
    for d in shape:
        n *= d
    return buf[at : at + n * dtype.itemsize].view(dtype).view(shape)


def fill_header(buf: torch.Tensor, planned: Planned) -> None:
    """Write the header into `buf`."""
    head = planned.header
    buf[: len(head)].copy_(torch.frombuffer(bytearray(head), dtype=torch.uint8))


def slots(buf: torch.Tensor, planned: Planned) -> dict[str, torch.Tensor]:
    """Every planned tensor's place in `buf`, as a tensor of its dtype and shape."""
    return {key: _view(buf, d, s, at) for key, (d, s, at) in planned.entries.items()}


def _crc(
    buf: torch.Tensor, end: int, kind: Checksum, ready: Callable[[int], None] | None = None
) -> int:
    return checksum(buf.numpy().data[:end], kind, ready)


def seal(buf: torch.Tensor, ready: Callable[[int | None], None] | None = None) -> int:
    """Write the trailer (the `CHECKSUM` of everything before it); return it. `ready`
    (`HostCopy.start`'s): the bytes below an address may still be arriving."""
    end = buf.numel() - _TRAILER.size
    base = buf.data_ptr()
    crc = _crc(buf, end, CHECKSUM, None if ready is None else lambda at: ready(base + at))
    if ready is not None:
        ready(None)
    tail = _TRAILER.pack(_MAGIC, end, crc, _CHECKSUMS.index(CHECKSUM))
    buf[end:].copy_(torch.frombuffer(bytearray(tail), dtype=torch.uint8))
    return crc


def _trailer(buf: torch.Tensor, where: str) -> tuple[Checksum, int]:
    if buf.numel() < _TRAILER.size:
        raise ChecksumError(f"{where}: {buf.numel()} bytes, too short for a snapshot")
    magic, end, crc, code = _TRAILER.unpack(bytes(buf[-_TRAILER.size :].numpy()))
    if magic != _MAGIC or end != buf.numel() - _TRAILER.size:
        raise ChecksumError(f"{where}: no intact snapshot trailer (a write that did not end?)")
    if code >= len(_CHECKSUMS):
        known = ", ".join(f"{c} ({k.name})" for c, k in enumerate(_CHECKSUMS))
        raise ChecksumError(
            f"{where}: the trailer records checksum {code}, unknown to this version of "
            f"zeroshard (it knows {known}): written by a newer one?"
        )
    return _CHECKSUMS[code], int(crc)


def trailer_crc(buf: torch.Tensor, where: str) -> int:
    """The checksum the trailer records; ChecksumError when there is no trailer or it
    names a checksum this version does not know."""
    return _trailer(buf, where)[1]


def check(buf: torch.Tensor, where: str) -> None:
    """ChecksumError unless the bytes are a whole snapshot with the checksum it records."""
    kind, want = _trailer(buf, where)
    got = _crc(buf, buf.numel() - _TRAILER.size, kind)
    if got != want:
        raise ChecksumError(f"{where}: {kind.name} is {got:08x}, the snapshot records {want:08x}")


def parse(buf: torch.Tensor, where: str) -> Snapshot:
    """The snapshot in checked bytes `buf` (CheckpointError when it is malformed)."""
    try:
        (n,) = struct.unpack("<Q", bytes(buf[:8].numpy()))
        doc = json.loads(bytes(buf[8 : 8 + n].numpy()))
        tensors = {  # offsets count from the end of the header
            key: _view(buf, safetensors_dtype(code), tuple(shape), 8 + n + at)
            for key, (code, shape, at) in doc["tensors"].items()
        }
        meta = None if doc["meta"] is None else CheckpointMeta.from_json(doc["meta"])
        extra = None
        if doc["extra"] is not None:
            # Copies: the user's state outlives the bytes (and torch's set_rng_state wants
            # a tensor of its own, not a view at an offset).
            mine = {k[len(_EXTRA) :]: t.clone() for k, t in tensors.items() if k.startswith(_EXTRA)}
            extra = RankExtra(str(doc["extra"]), mine)
        tensors = {k: t for k, t in tensors.items() if not k.startswith(_EXTRA)}
        return Snapshot(
            int(doc["step"]),
            int(doc["rank"]),
            int(doc["world_size"]),
            meta,
            tensors,
            extra,
            doc.get("journal"),
        )
    except (KeyError, TypeError, ValueError, struct.error) as e:
        if isinstance(e, CheckpointError):
            raise
        raise CheckpointError(f"{where}: malformed snapshot ({e!r})") from e


def mapped(path: Path, size: int | None = None) -> torch.Tensor:
    """The bytes of file `path` as a uint8 tensor over shared memory: a new file of
    `size` bytes, or (None) the existing one, copy-on-write (writes stay private)."""
    flags = os.O_RDWR | (os.O_CREAT | os.O_TRUNC if size is not None else 0)
    fd = os.open(path, flags, 0o600)
    try:
        if size is not None and size > 0:
            # Reserved now: a full /dev/shm is an OSError here, not a SIGBUS at a write.
            os.posix_fallocate(fd, 0, size)
        length = os.fstat(fd).st_size
        if length == 0:
            return torch.empty(0, dtype=torch.uint8)
        access = mmap.ACCESS_WRITE if size is not None else mmap.ACCESS_COPY
        # The tensor keeps the map alive; the memory goes when the last view does.
        return torch.frombuffer(mmap.mmap(fd, length, access=access), dtype=torch.uint8)
    finally:
        os.close(fd)
