"""`empty_host`: pageable without CUDA; on CUDA pinned, and a large buffer pinned at its own
size, not rounded up to a power of two ([Note: exact pinning])."""

from __future__ import annotations

import gc
import os

import pytest
import torch

from zeroshard.partition import empty_host
from zeroshard.partition._host import EXACT_PIN_BYTES

MIB = 2**20


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_pageable_without_pinning() -> None:
    t, pinned = empty_host(1000, torch.bfloat16, pin=False)
    assert (t.numel(), t.dtype, t.device.type, pinned) == (1000, torch.bfloat16, "cpu", False)
    if not torch.cuda.is_available():
        t, pinned = empty_host(1000, torch.bfloat16, pin=True)
        assert not pinned and not t.is_pinned()


@pytest.mark.gpu
def test_large_buffers_pinned_at_their_size(device: str) -> None:
    if device != "cuda":
        pytest.skip("pinning needs CUDA; run with --device cuda")
    small, pinned = empty_host(1000, torch.bfloat16, pin=True)
    assert pinned and small.is_pinned()
    # 1.5x the threshold, and odd: torch's allocator would pin the next power of two.
    numel = 3 * EXACT_PIN_BYTES // 4 + 7
    nbytes = numel * 2
    before = _rss()
    t, pinned = empty_host(numel, torch.bfloat16, pin=True)
    grown = _rss() - before
    assert pinned and t.is_pinned() and t.numel() == numel
    assert t.data_ptr() % 64 == 0
    # Page-locking makes the pages resident: the buffer's 384 MiB, not 512 rounded up.
    assert 0.9 * nbytes <= grown <= nbytes + 64 * MIB, (grown / MIB, nbytes / MIB)
    # Asynchronous copies both ways see the same bytes.
    t.copy_(torch.arange(numel, dtype=torch.float32).remainder_(251))
    on_device = t.to("cuda", non_blocking=True)
    view = t[numel // 2 :]
    back, _ = empty_host(numel, torch.bfloat16, pin=True)
    back.copy_(on_device, non_blocking=True)
    torch.cuda.synchronize()
    assert torch.equal(back, t)
    # The memory is unlocked and freed with the last tensor viewing it.
    del t, back, on_device
    gc.collect()
    assert view.is_pinned(), "a view keeps the buffer locked"
    del view
    gc.collect()
    assert _rss() - before <= 64 * MIB, (_rss() - before) / MIB
