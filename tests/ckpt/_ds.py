"""Shared helper of the DeepSpeed tests: a checkpoint's specs and tied aliases."""

from __future__ import annotations

from pathlib import Path

from zeroshard.ckpt import read_deepspeed_checkpoint
from zeroshard.ckpt._spec import TensorSpec


def deepspeed_specs(
    path: Path, tag: str | None = None, *, exclude_frozen: bool = False
) -> tuple[list[TensorSpec], dict[str, str]]:
    """The consolidation specs of a DeepSpeed checkpoint and its {alias: canonical}."""
    ckpt = read_deepspeed_checkpoint(path, tag, exclude_frozen=exclude_frozen)
    return list(ckpt.specs), dict(ckpt.aliases)
