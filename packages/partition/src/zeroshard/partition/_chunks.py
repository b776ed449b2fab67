"""Chunks: a flat buffer cut into fixed-size pieces, each sharded evenly over all ranks.

Chunk i covers elements [i * chunk_numel, (i + 1) * chunk_numel) of the buffer padded to
`padded_numel`; rank r's shard of it is the r-th of `world_size` equal parts. Every
chunk has the same size, so when a chunk moves (gathered, offloaded, prefetched) every
rank moves the same number of bytes and no rank waits on a larger peer.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import torch

from zeroshard.comm import warn_on_rank0, warn_tagged
from zeroshard.partition._host import empty_host

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


class ChunkedBuffer:
    """One rank's shards of every chunk on `device`, with optional host copies.

    `shard(i)` is chunk i's shard on the device; `to_host(i)` / `to_device(i)` copy it
    to / from its host copy (pinned when CUDA allows, else pageable with one warning).
    With `non_blocking=True` and pinned memory the copy is queued on the current CUDA
    stream: synchronize (or wait on an event) before reading the destination or
    reusing the source.
    """

    def __init__(
        self,
        layout: ChunkLayout,
        rank: int,
        *,
        dtype: torch.dtype,
        device: torch.device,
        host_copies: bool = False,
        pin: bool = True,
    ) -> None:
        if not 0 <= rank < layout.world_size:
            raise ValueError(f"rank {rank} out of range for world size {layout.world_size}")
        self.layout = layout
        self.rank = rank
        self.dtype = dtype
        self.device = torch.device(device)
        n, s = layout.num_chunks, layout.shard_numel
        # One allocation for all chunks: chunk i is row i, so chunk moves are views.
        self.data = torch.zeros(n, s, dtype=dtype, device=self.device)
        self.host: torch.Tensor | None = None
        self.pinned = False
        if host_copies:
            flat, self.pinned = empty_host(n * s, dtype, pin=pin)
            self.host = flat.view(n, s)
            if pin and not self.pinned:
                # No CUDA is the same on every rank (warn once); a failed pin may not be.
                warn = warn_on_rank0 if not torch.cuda.is_available() else warn_tagged
                why = "no CUDA" if not torch.cuda.is_available() else "pinning failed"
                warn(
                    f"ChunkedBuffer: host copies use pageable memory ({why}); "
                    "host<->device copies will be synchronous and slower",
                    RuntimeWarning,
                )

    def shard(self, i: int) -> torch.Tensor:
        """Chunk i's shard on the device (a view; shard_numel elements)."""
        self.layout._check_chunk(i)
        return self.data[i]

    def _host(self, i: int) -> torch.Tensor:
        self.layout._check_chunk(i)
        if self.host is None:
            raise ValueError("this ChunkedBuffer has no host copies (host_copies=False)")
        return self.host[i]

    def to_host(self, i: int, *, non_blocking: bool = False) -> torch.Tensor:
        """Copy chunk i's device shard to its host copy; return the host copy."""
        dst = self._host(i)
        dst.copy_(self.data[i], non_blocking=non_blocking and self.pinned)
        return dst

    def to_device(self, i: int, *, non_blocking: bool = False) -> torch.Tensor:
        """Copy chunk i's host copy to its device shard; return the device shard."""
        src = self._host(i)
        self.data[i].copy_(src, non_blocking=non_blocking and self.pinned)
        return self.data[i]

    @torch.no_grad()
    def load(self, flat: torch.Tensor) -> None:
        """Fill this rank's shards from a full flat buffer (at most padded_numel long)."""
        lay = self.layout
        if flat.dim() != 1 or flat.numel() > lay.padded_numel:
            raise ValueError(
                f"ChunkedBuffer.load: expected a 1-D buffer of at most {lay.padded_numel} "
                f"elements, got shape {tuple(flat.shape)}"
            )
        self.data.zero_()
        for i in range(lay.num_chunks):
            lo, hi = lay.shard_range(i, self.rank)
            hi = min(hi, flat.numel())
            if lo < hi:
                self.data[i, : hi - lo].copy_(flat[lo:hi])
