"""Host (CPU) buffers, pinned when the platform allows it."""

from __future__ import annotations

import torch


def empty_host(numel: int, dtype: torch.dtype, *, pin: bool) -> tuple[torch.Tensor, bool]:
    """An uninitialised 1-D host tensor and whether it is pinned.

    Pinned (page-locked) memory lets host<->device copies run asynchronously and at full
    bus speed; it needs CUDA, and a large pin can fail where pageable memory would not,
    so any failure falls back to pageable memory. The caller decides whether to warn.
    """
    if pin and torch.cuda.is_available():
        try:
            return torch.empty(numel, dtype=dtype, pin_memory=True), True
        except RuntimeError:
            pass
    return torch.empty(numel, dtype=dtype), False
