"""Shared helpers for the partition tests: random parameters and independent references.

Rank processes import this module: keep hypothesis out of it (see _strategies.py).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from zeroshard.partition import FlatLayout

DTYPES = (
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.float64,
    torch.int64,
    torch.int32,
    torch.int8,
    torch.uint8,
    torch.bool,
)


def random_bits(shape: Sequence[int], dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """A CPU tensor of random bit patterns (NaN payloads, subnormals and all), valid bools."""
    numel = math.prod(shape)
    if dtype == torch.bool:
        return torch.randint(0, 2, tuple(shape), generator=gen).bool()
    raw = torch.randint(0, 256, (numel * dtype.itemsize,), dtype=torch.uint8, generator=gen)
    return raw.view(dtype).view(tuple(shape))


def random_params(layout: FlatLayout, seed: int) -> list[torch.Tensor]:
    """One random-bits CPU tensor per slot, deterministic in `seed`."""
    gen = torch.Generator().manual_seed(seed)
    return [random_bits(s.shape, layout.dtype, gen) for s in layout.slots]


def reference_flat(tensors: Sequence[torch.Tensor], layout: FlatLayout) -> torch.Tensor:
    """The padded flat buffer built the obvious way: zeros, then each slot written in."""
    ref = torch.zeros(layout.padded_numel, dtype=layout.dtype)
    for t, s in zip(tensors, layout.slots, strict=True):
        ref[s.offset : s.end] = t.detach().cpu().reshape(-1)
    return ref


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes on the CPU (bitwise comparisons, NaNs included)."""
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8)


def bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same dtype, shape and bytes."""
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(as_bytes(a), as_bytes(b))
