"""`FlatLayout`: where each parameter lives in a flat buffer, and how it is sharded.

A layout is pure metadata (no tensors): checkpoints store it as JSON so that
consolidation and resharding need no model code.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import torch

FORMAT_VERSION = 1

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
    "int64": torch.int64,
    "int32": torch.int32,
    "int16": torch.int16,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "bool": torch.bool,
}
# fp8 weights appear in mixed-precision checkpoints; older torch builds may lack them.
for _name in ("float8_e4m3fn", "float8_e5m2"):
    if hasattr(torch, _name):
        _DTYPES[_name] = getattr(torch, _name)


def dtype_name(dtype: torch.dtype) -> str:
    """The short name of a dtype ('float32', 'bfloat16', ...)."""
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    """The torch dtype for a short name; ValueError for an unknown one."""
    try:
        return _DTYPES[name]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; known: {sorted(_DTYPES)}") from None


@dataclass(frozen=True)
class Slot:
    """One parameter in a flat buffer: elements [offset, offset + numel)."""

    name: str
    shape: tuple[int, ...]
    offset: int
    numel: int

    @property
    def end(self) -> int:
        """One past the slot's last element."""
        return self.offset + self.numel


@dataclass(frozen=True)
class Piece:
    """The part of a slot that one rank's shard holds.

    Elements [slot_start, slot_start + numel) of the flattened parameter are at
    [shard_start, shard_start + numel) of rank `rank`'s shard.
    """

    rank: int
    slot_start: int
    shard_start: int
    numel: int


@dataclass(frozen=True)
class FlatLayout:
    """Ordered slots of one dtype in a flat buffer, padded to split evenly over `world_size`.

    `alignment` is in elements: every slot starts at a multiple of it, and every shard
    is a multiple of it long. `padded_numel` is divisible by `world_size * alignment`.
    """

    slots: tuple[Slot, ...]
    dtype: torch.dtype
    world_size: int
    alignment: int
    padded_numel: int

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {self.world_size}")
        if self.alignment < 1:
            raise ValueError(f"alignment must be >= 1, got {self.alignment}")
        if self.padded_numel % (self.world_size * self.alignment):
            raise ValueError(
                f"padded_numel {self.padded_numel} is not a multiple of "
                f"world_size * alignment = {self.world_size * self.alignment}"
            )
        end = 0
        names: set[str] = set()
        for s in self.slots:
            if s.name in names:
                raise ValueError(f"parameter {s.name!r} appears twice in one layout")
            names.add(s.name)
            if any(d < 0 for d in s.shape):
                raise ValueError(f"slot {s.name!r} has a negative dimension in {s.shape}")
            if s.offset < end or s.offset % self.alignment:
                raise ValueError(f"slot {s.name!r} at offset {s.offset} overlaps or is unaligned")
            if s.numel != math.prod(s.shape):
                raise ValueError(f"slot {s.name!r}: numel {s.numel} != prod{s.shape}")
            end = s.end
        if end > self.padded_numel:
            raise ValueError(f"slots end at {end}, past padded_numel {self.padded_numel}")

    @staticmethod
    def build(
        named_shapes: Sequence[tuple[str, Sequence[int]]],
        dtype: torch.dtype,
        world_size: int,
        alignment: int = 1,
    ) -> FlatLayout:
        """Lay the named shapes out in order, each slot aligned, padded for `world_size`."""
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        if alignment < 1:
            raise ValueError(f"alignment must be >= 1, got {alignment}")
        if not named_shapes:
            raise ValueError("a flat layout needs at least one parameter (empty group)")
        slots: list[Slot] = []
        seen: set[str] = set()
        offset = 0
        for name, shape in named_shapes:
            if name in seen:
                raise ValueError(f"parameter {name!r} appears twice in one layout")
            seen.add(name)
            if any(int(d) < 0 for d in shape):
                raise ValueError(f"parameter {name!r} has a negative dimension in {tuple(shape)}")
            numel = math.prod(shape)
            slots.append(Slot(name, tuple(int(d) for d in shape), offset, numel))
            offset += -(-numel // alignment) * alignment
        unit = world_size * alignment
        padded = max(unit, -(-offset // unit) * unit)
        return FlatLayout(tuple(slots), dtype, world_size, alignment, padded)

    @property
    def numel(self) -> int:
        """Elements used by slots (end of the last slot)."""
        return self.slots[-1].end if self.slots else 0

    @property
    def shard_numel(self) -> int:
        """Elements in every rank's shard."""
        return self.padded_numel // self.world_size

    @cached_property
    def _index(self) -> dict[str, int]:
        return {s.name: i for i, s in enumerate(self.slots)}

    def slot(self, name: str) -> Slot:
        """The slot of a parameter, by name."""
        try:
            return self.slots[self._index[name]]
        except KeyError:
            raise KeyError(f"no parameter {name!r} in this layout") from None

    def shard_range(self, rank: int) -> tuple[int, int]:
        """[start, end) of rank `rank`'s shard in the padded flat buffer."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} out of range for world size {self.world_size}")
        n = self.shard_numel
        return rank * n, (rank + 1) * n

    def pieces(self, slot: Slot | str) -> tuple[Piece, ...]:
        """The pieces of a slot, one per rank whose shard it overlaps, in rank order."""
        s = self.slot(slot) if isinstance(slot, str) else slot
        n = self.shard_numel
        out: list[Piece] = []
        if s.numel == 0:
            return ()
        for rank in range(s.offset // n, (s.end - 1) // n + 1):
            lo = max(s.offset, rank * n)
            hi = min(s.end, (rank + 1) * n)
            out.append(Piece(rank, lo - s.offset, lo - rank * n, hi - lo))
        return tuple(out)

    def slots_in_shard(self, rank: int) -> tuple[tuple[Slot, Piece], ...]:
        """Every (slot, piece) that lies in rank `rank`'s shard, in offset order."""
        start, end = self.shard_range(rank)
        out: list[tuple[Slot, Piece]] = []
        for s in self.slots:
            if s.end <= start or s.offset >= end or s.numel == 0:
                continue
            for p in self.pieces(s):
                if p.rank == rank:
                    out.append((s, p))
        return tuple(out)

    def split_sizes(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """Consecutive sizes that split the padded buffer into every slot, alignment gap
        and the padding (for one `Tensor.split`), and the index of each slot's piece."""
        sizes: list[int] = []
        piece_of_slot: list[int] = []
        end = 0
        for s in self.slots:
            if s.offset > end:
                sizes.append(s.offset - end)
            piece_of_slot.append(len(sizes))
            sizes.append(s.numel)
            end = s.end
        if self.padded_numel > end:
            sizes.append(self.padded_numel - end)
        return tuple(sizes), tuple(piece_of_slot)

    def resharded(self, world_size: int) -> FlatLayout:
        """The same slots padded for another world size (offsets unchanged)."""
        unit = world_size * self.alignment
        padded = max(unit, -(-self.numel // unit) * unit)
        return FlatLayout(self.slots, self.dtype, world_size, self.alignment, padded)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict with a format version."""
        return {
            "format": FORMAT_VERSION,
            "dtype": dtype_name(self.dtype),
            "world_size": self.world_size,
            "alignment": self.alignment,
            "padded_numel": self.padded_numel,
            "slots": [[s.name, list(s.shape), s.offset, s.numel] for s in self.slots],
        }

    def to_json(self) -> str:
        """The layout as JSON text; `from_json` reads it back."""
        return json.dumps(self.to_dict(), separators=(",", ":"))

    @staticmethod
    def from_dict(d: dict[str, Any]) -> FlatLayout:
        """Read `to_dict()` output; ValueError for an unknown format version or bad fields."""
        if not isinstance(d, dict):
            raise ValueError(f"malformed FlatLayout: expected an object, got {type(d).__name__}")
        version = d.get("format")
        if version != FORMAT_VERSION:
            raise ValueError(
                f"unknown FlatLayout format version {version!r} (this build reads {FORMAT_VERSION})"
            )
        try:
            slots = tuple(
                Slot(str(name), tuple(int(x) for x in shape), int(offset), int(numel))
                for name, shape, offset, numel in d["slots"]
            )
            return FlatLayout(
                slots,
                dtype_from_name(str(d["dtype"])),
                int(d["world_size"]),
                int(d["alignment"]),
                int(d["padded_numel"]),
            )
        except (KeyError, TypeError) as e:
            raise ValueError(f"malformed FlatLayout: {e!r}") from e

    @staticmethod
    def from_json(text: str) -> FlatLayout:
        """Parse `to_json()` output."""
        return FlatLayout.from_dict(json.loads(text))
