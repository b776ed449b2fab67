"""What a checkpoint source gives the benchmark: how its ranks write a checkpoint, what the
checkpoint holds, and its own tool's command lines (`Source`, one module per source)."""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from zeroshard.ckpt._spec import TensorSpec


@dataclass(frozen=True)
class Checkpoint:
    """What consolidation must read and write (zeroshard's specs of every tensor), the world
    that wrote it and its rank files."""

    specs: Sequence[TensorSpec]
    world: int
    shard_files: list[Path]

    @property
    def params(self) -> int:
        """Elements of every tensor."""
        return sum(s.numel for s in self.specs)

    @property
    def read_bytes(self) -> int:
        """What consolidation must read: every tensor as stored."""
        return sum(s.numel * s.dtype.itemsize for s in self.specs)

    @property
    def out_bytes(self) -> int:
        """The output: every floating tensor in fp32 (both tools' default), others as stored."""
        return sum(
            s.numel * (4 if s.dtype.is_floating_point else s.dtype.itemsize) for s in self.specs
        )


@dataclass(frozen=True)
class Command:
    """One way to run the source's own tool: its label in the report and its argv."""

    label: str
    argv: Callable[[Path, Path], list[str]]  # (checkpoint, output directory) -> argv


@dataclass(frozen=True)
class Source:
    """A checkpoint format and the framework that writes it (DeepSpeed, FSDP2's DCP).

    Its functions are module-level, so spawned ranks can unpickle `make_rank`.
    """

    name: str  # --source
    section: str  # its section of docs/benchmarks.md
    title: str
    kind: str  # what the checkpoint is, e.g. "DeepSpeed ZeRO-3 checkpoint"
    made_by: str  # the framework whose ranks write it
    shard_files: str  # what its rank files are, e.g. "optimizer files"
    peer: str  # the framework's own consolidation tool
    # On one of `world` ranks, process group joined: write the checkpoint of the GPT of
    # the command line's options to `out`.
    make_rank: Callable[[int, int, argparse.Namespace, Path], None]
    # What the checkpoint at a path holds, read with zeroshard's own reader.
    read: Callable[[Path], Checkpoint]
    # The peer tool's command lines, tried in order until one succeeds.
    peer_commands: tuple[Command, ...]
    # The goals apply (>= 3x the peer, <= 1.4x the floor, <= 2 GiB).
    has_goals: bool = False
