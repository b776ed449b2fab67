"""The CUDA side of [Note: streams and memory] (zeroshard/comm/_group.py), on NCCL.

A peer that joins late keeps a collective pending for a known time, which makes the
stream and allocator behaviour observable: the host must not block in `wait()`, memory
issued on a side stream and waited on another must not be handed out again while the
collective may still touch it, and nothing may stay allocated after the handles are done.
"""

from __future__ import annotations

import time

import pytest
import torch

from tests._dist import run_ranks, world_fits
from tests.comm._data import rank_device
from zeroshard.comm import Group

DELAY_S = 1.0
N = 1 << 20


def _late_peer(group: Group, delay: float) -> None:
    """Line the ranks up, then hold rank 1 back for `delay` seconds on the host."""
    group.barrier()
    if group.rank == 1:
        time.sleep(delay)


def _wait_does_not_block_host(group: Group, dev: torch.device, delay: float) -> None:
    x = torch.full((N,), float(group.rank), device=dev)
    out = torch.empty(group.size * N, device=dev)
    _late_peer(group, delay)
    start = time.monotonic()
    group.all_gather_into(out, x, label="late peer").wait()
    waited = time.monotonic() - start
    if group.rank == 0 and delay:
        assert waited < delay / 2, f"wait() blocked the host for {waited:.2f}s"
        # The current stream, not the host, is what waits on rank 1.
        assert not torch.cuda.current_stream(dev).query()
    torch.cuda.synchronize(dev)
    expected = torch.arange(group.size, dtype=torch.float32).repeat_interleave(N)
    assert torch.equal(out.cpu(), expected)


def _side_stream_memory_not_reused_early(group: Group, dev: torch.device, delay: float) -> None:
    side = torch.cuda.Stream(dev)  # type: ignore[no-untyped-call]
    _late_peer(group, delay)
    side.wait_stream(torch.cuda.current_stream(dev))
    with torch.cuda.stream(side):
        # Prefetch-style: buffers allocated and the gather issued on the side stream.
        shard = torch.full((N,), group.rank + 1.0, device=dev)
        gathered = torch.empty(group.size * N, device=dev)
        handle = group.all_gather_into(gathered, shard, label="prefetch")
    handle.wait()  # on the default stream
    first = gathered.clone()  # read on the default stream, after its wait
    nbytes = gathered.untyped_storage().nbytes()
    if group.rank == 0 and delay:
        # Rank 1 has not joined yet, so the collective still owns its buffers: the check
        # below is only meaningful while that holds.
        assert not torch.cuda.current_stream(dev).query(), "the peer was not late"
    del shard, gathered, handle
    with torch.cuda.stream(side):
        # Runs at once (the side stream waits on nothing): if the allocator handed out a
        # buffer NCCL still writes, the gathered values would land in `probe` later.
        probe = torch.empty(nbytes // 4, device=dev)
        probe.fill_(-1.0)
    torch.cuda.synchronize(dev)
    assert bool((probe == -1.0).all()), "a buffer NCCL still wrote was handed out again"
    expected = torch.arange(1, group.size + 1, dtype=torch.float32).repeat_interleave(N)
    assert torch.equal(first.cpu().reshape(-1), expected)


def _no_memory_left_behind(group: Group, dev: torch.device) -> None:
    side = torch.cuda.Stream(dev)  # type: ignore[no-untyped-call]
    sizes = (N, 3 * group.size, N // 3 * group.size, 4096)
    tensors = [torch.randn(n, device=dev) for n in sizes]
    torch.cuda.synchronize(dev)
    base = torch.cuda.memory_allocated(dev)
    for _ in range(10):
        side.wait_stream(torch.cuda.current_stream(dev))
        handles = []
        with torch.cuda.stream(side):
            # Outputs allocated on the side stream, waited on the default one.
            for t in tensors:
                full = torch.empty(t.numel() * group.size, device=dev)
                part = torch.empty(t.numel() // group.size, device=dev)
                handles.append(group.all_gather_into(full, t))
                handles.append(group.reduce_scatter(part, t[: part.numel() * group.size]))
        for h in handles:
            h.wait()
        del full, part, handles
    torch.cuda.synchronize(dev)
    # torch's watchdog drops its copy of a finished work within ~0.1 s: allow it 2 s.
    deadline = time.monotonic() + 2.0
    while torch.cuda.memory_allocated(dev) != base and time.monotonic() < deadline:
        time.sleep(0.05)
    assert torch.cuda.memory_allocated(dev) == base, torch.cuda.memory_allocated(dev) - base


def _body() -> None:
    group, dev = Group(), rank_device()
    # Warm-up: run every check once with no late peer. The communicator is created on
    # first use and NCCL connects each algorithm lazily, blocking the host until the peer
    # joins; and under CUDA's lazy module loading the first launch of a kernel (the
    # clone's strided copy, say) waits for the kernels already running, the pending
    # collective included. After the warm-up a late peer delays only the device, which
    # is what the checks observe.
    _wait_does_not_block_host(group, dev, 0.0)
    _side_stream_memory_not_reused_early(group, dev, 0.0)
    _wait_does_not_block_host(group, dev, DELAY_S)
    _side_stream_memory_not_reused_early(group, dev, DELAY_S)
    _no_memory_left_behind(group, dev)
    group.barrier()


@pytest.mark.gpu
def test_stream_order_and_memory(device: str) -> None:
    """Non-blocking wait, no early reuse of side-stream buffers, no leak (CUDA only)."""
    if device != "cuda":
        pytest.skip("streams and the caching allocator exist only on CUDA")
    world_fits(device, 2)
    run_ranks(_body, 2, device=device)
