"""`TensorSpec`: one output tensor of a consolidation, known before any data is read.

Both sources of a consolidation (zeroshard checkpoints and DeepSpeed ZeRO checkpoints)
describe their output as a list of specs; the streamed safetensors writer lays out
every header from them first, then has workers fill each tensor at its offset.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TensorSpec:
    """A full tensor to write: its name, shape, source dtype and how to read it.

    `read(out)` fills `out`, a contiguous 1-D tensor of `numel` elements and dtype
    `dtype`, from the rank pieces on disk. It must be safe to call from worker threads.
    """

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    read: Callable[[torch.Tensor], None]

    @property
    def numel(self) -> int:
        """Number of elements."""
        return math.prod(self.shape)
