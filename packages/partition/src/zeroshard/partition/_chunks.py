"""Chunks: a flat buffer cut into fixed-size pieces, each sharded evenly over all ranks.

Chunk i covers elements [i * chunk_numel, (i + 1) * chunk_numel) of the buffer padded to
`padded_numel`; rank r's shard of it is the r-th of `world_size` equal parts. Every
chunk has the same size, so when a chunk moves (gathered, offloaded, prefetched) every
rank moves the same number of bytes and no rank waits on a larger peer.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

CHUNK_FORMAT_VERSION = 1


@dataclass(frozen=True)
class ChunkLayout:
    """`numel` elements in `num_chunks` chunks of `chunk_numel` (a multiple of `world_size`)."""

    numel: int
    chunk_numel: int
    world_size: int

    def __post_init__(self) -> None:
        if self.numel < 0:
            raise ValueError(f"numel must be >= 0, got {self.numel}")
        if self.world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {self.world_size}")
        if self.chunk_numel < 1 or self.chunk_numel % self.world_size:
            raise ValueError(
                f"chunk_numel {self.chunk_numel} must be a positive multiple of "
                f"world_size {self.world_size}"
            )

    @staticmethod
    def build(numel: int, chunk_numel: int, world_size: int) -> ChunkLayout:
        """Chunks of at least `chunk_numel` elements, rounded up to a multiple of `world_size`."""
        if chunk_numel < 1:
            raise ValueError(f"chunk_numel must be >= 1, got {chunk_numel}")
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        return ChunkLayout(numel, -(-chunk_numel // world_size) * world_size, world_size)

    @property
    def num_chunks(self) -> int:
        """How many chunks cover `numel` elements (0 for an empty buffer)."""
        return -(-self.numel // self.chunk_numel)

    @property
    def padded_numel(self) -> int:
        """Elements of the buffer padded to whole chunks."""
        return self.num_chunks * self.chunk_numel

    @property
    def shard_numel(self) -> int:
        """Elements of one rank's shard of one chunk."""
        return self.chunk_numel // self.world_size

    def _check_chunk(self, i: int) -> None:
        if not 0 <= i < self.num_chunks:
            raise ValueError(f"chunk {i} out of range: this layout has {self.num_chunks} chunks")

    def chunk_range(self, i: int) -> tuple[int, int]:
        """[start, end) of chunk i in the padded buffer."""
        self._check_chunk(i)
        return i * self.chunk_numel, (i + 1) * self.chunk_numel

    def shard_range(self, i: int, rank: int) -> tuple[int, int]:
        """[start, end) of rank `rank`'s shard of chunk i in the padded buffer."""
        self._check_chunk(i)
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} out of range for world size {self.world_size}")
        start = i * self.chunk_numel + rank * self.shard_numel
        return start, start + self.shard_numel

    def to_json(self) -> str:
        """The layout as JSON text with a format version; `from_json` reads it back."""
        return json.dumps(
            {
                "format": CHUNK_FORMAT_VERSION,
                "numel": self.numel,
                "chunk_numel": self.chunk_numel,
                "world_size": self.world_size,
            },
            separators=(",", ":"),
        )

    @staticmethod
    def from_json(text: str) -> ChunkLayout:
        """Parse `to_json()` output; ValueError for another format version or bad fields."""
        d = json.loads(text)
        if not isinstance(d, dict):
            raise ValueError(f"malformed ChunkLayout: expected a JSON object, got {d!r}")
        if d.get("format") != CHUNK_FORMAT_VERSION:
            raise ValueError(
                f"unknown ChunkLayout format version {d.get('format')!r} "
                f"(this build reads {CHUNK_FORMAT_VERSION})"
            )
        try:
            return ChunkLayout(int(d["numel"]), int(d["chunk_numel"]), int(d["world_size"]))
        except (KeyError, TypeError) as e:
            raise ValueError(f"malformed ChunkLayout: {e!r}") from e
