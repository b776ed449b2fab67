"""Shared helpers of the DeepSpeed tests: a checkpoint's specs, and tensor digests."""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch

from zeroshard.ckpt import read_deepspeed_checkpoint
from zeroshard.ckpt._spec import TensorSpec


def deepspeed_specs(
    path: Path, tag: str | None = None, *, exclude_frozen: bool = False
) -> tuple[list[TensorSpec], dict[str, str]]:
    """The consolidation specs of a DeepSpeed checkpoint and its {alias: canonical}."""
    ckpt = read_deepspeed_checkpoint(path, tag, exclude_frozen=exclude_frozen)
    return list(ckpt.specs), dict(ckpt.aliases)


def digest(tensor: torch.Tensor) -> str:
    """SHA-256 of a tensor's dtype, shape and bytes, as make_fixtures.py records them."""
    h = hashlib.sha256(f"{tensor.dtype}{tuple(tensor.shape)}".encode())
    h.update(tensor.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()
