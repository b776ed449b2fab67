"""What a checkpoint source gives the benchmark: how its ranks write a checkpoint, what the
checkpoint holds, and its own tool's command lines (`Source`, one module per source)."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch


@dataclass(frozen=True)
class Checkpoint:
    """What consolidation must read and write: every tensor's element count and dtype, the
    world that wrote it and its rank files."""

    numels: list[int]
    dtypes: list[torch.dtype]
    world: int
    shard_files: list[Path]

    @property
    def params(self) -> int:
        """Elements of every tensor."""
        return sum(self.numels)

    @property
    def read_bytes(self) -> int:
        """What consolidation must read: every tensor as stored."""
        return sum(n * d.itemsize for n, d in zip(self.numels, self.dtypes, strict=True))

    @property
    def out_bytes(self) -> int:
        """The output: every floating tensor in fp32 (both tools' default), others as stored."""
        return sum(
            n * (4 if d.is_floating_point else d.itemsize)
            for n, d in zip(self.numels, self.dtypes, strict=True)
        )


@dataclass(frozen=True)
class Command:
    """One way to run the source's own tool: its label in the report and its argv."""

    label: str
    argv: Callable[[Path, Path], list[str]]  # (checkpoint, output directory) -> argv


class Source(Protocol):
    """A checkpoint format and the framework that writes it (DeepSpeed, FSDP2's DCP)."""

    @property
    def name(self) -> str:
        """Its `--source`."""
        ...

    @property
    def section(self) -> str:
        """Its section of docs/benchmarks.md."""
        ...

    @property
    def title(self) -> str:
        """The section's title."""
        ...

    @property
    def kind(self) -> str:
        """What the checkpoint is, e.g. "DeepSpeed ZeRO-3 checkpoint"."""
        ...

    @property
    def made_by(self) -> str:
        """The framework whose ranks write it."""
        ...

    @property
    def shard_files(self) -> str:
        """What its rank files are, e.g. "optimizer files"."""
        ...

    @property
    def peer(self) -> str:
        """The framework's own consolidation tool."""
        ...

    @property
    def has_goals(self) -> bool:
        """The issue's goals apply (>= 3x the peer, <= 1.4x the floor, <= 2 GiB)."""
        ...

    def make_rank(self, rank: int, world: int, args: argparse.Namespace, out: Path) -> None:
        """On one of `world` ranks (process group joined): write the checkpoint to `out`."""
        ...

    def read(self, ckpt: Path) -> Checkpoint:
        """What the checkpoint at `ckpt` holds, read with zeroshard's own reader."""
        ...

    def peer_commands(self) -> list[Command]:
        """The peer tool's command lines, tried in order until one succeeds."""
        ...
