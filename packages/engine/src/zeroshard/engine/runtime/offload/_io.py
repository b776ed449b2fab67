"""The host side of offload's copies: host buffers, side streams, the gradient worker.

See [Note: offload stream order] in _host_offload.py for the order these serve.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from zeroshard.comm import warn_tagged
from zeroshard.partition import empty_host

_warned_pageable = False


def host_tensor(numel: int, dtype: torch.dtype, *, pin: bool) -> tuple[torch.Tensor, bool]:
    """A zeroed 1-D host tensor and whether it is pinned; pageable (warned once) if pinning
    fails."""
    global _warned_pageable
    t, pinned = empty_host(numel, dtype, pin=pin)
    if pin and not pinned and not _warned_pageable:
        _warned_pageable = True
        # Pinning may fail on some ranks only: each says so, naming itself.
        warn_tagged(
            "zeroshard offload: pinned host memory could not be allocated; using pageable "
            "memory: host<->device copies will be synchronous and slower",
            RuntimeWarning,
        )
    return t.zero_(), pinned


class HostMemory:
    """The host tensors of one `HostOffload`, and their bytes (pinned of those)."""

    def __init__(self) -> None:
        self.host_bytes = 0
        self.pinned_bytes = 0

    def alloc(self, numel: int, dtype: torch.dtype, pin: bool) -> torch.Tensor:
        """A zeroed 1-D host tensor, pinned if asked and possible (`host_tensor`)."""
        t, pinned = host_tensor(numel, dtype, pin=pin)
        self.host_bytes += t.nbytes
        self.pinned_bytes += t.nbytes if pinned else 0
        return t

    def drop(self, t: torch.Tensor) -> None:
        """`t`, pageable and from `alloc`, is held no more."""
        self.host_bytes -= t.nbytes


class SideStream:
    """A CUDA side stream, or nothing on the CPU (where copies complete as they return)."""

    def __init__(self, device: torch.device) -> None:
        self.stream: torch.cuda.Stream | None = None
        if device.type == "cuda":
            self.stream = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]

    @contextlib.contextmanager
    def after_current(self) -> Iterator[None]:
        """Run the block on this stream, after what the current stream queued so far."""
        if self.stream is None:
            yield
            return
        self.stream.wait_stream(torch.cuda.current_stream(self.stream.device))
        with torch.cuda.stream(self.stream):
            yield

    @contextlib.contextmanager
    def after(self, event: torch.cuda.Event | None) -> Iterator[None]:
        """Run the block on this stream, after `event` (recorded on another stream)."""
        if self.stream is None:
            yield
            return
        if event is not None:
            self.stream.wait_event(event)
        with torch.cuda.stream(self.stream):
            yield

    def event(self) -> torch.cuda.Event | None:
        """An event recorded on this stream now (None on the CPU)."""
        if self.stream is None:
            return None
        ev = torch.cuda.Event()  # type: ignore[no-untyped-call]
        ev.record(self.stream)
        return ev


def grad_worker(
    device: torch.device, name: str = "zeroshard-offload-grads", *, threads: int | None = None
) -> ThreadPoolExecutor:
    """One thread running its tasks in order: the one that waits on gradient copies and adds
    staged gradients, or (named) the one that steps groups in backward, with `threads`
    intra-op threads if given ([Note: host step threads] in _threads.py)."""

    def init() -> None:
        if device.type == "cuda":
            # It waits on CUDA events: make this rank's device its current one, not
            # device 0 (where a first CUDA call would otherwise create a context).
            torch.cuda.set_device(device)
        if threads is not None:
            torch.set_num_threads(threads)

    return ThreadPoolExecutor(1, name, initializer=init)


@dataclass(frozen=True)
class GradAdd:
    """Add a staged gradient into the fp32 gradient `home`, first moving the group's
    gradient there from `source` (its reduce-dtype home) and applying `factors` when the
    group's first accumulation promotes it ([Note: offload host memory])."""

    home: torch.Tensor
    staged: torch.Tensor
    source: torch.Tensor | None
    factors: tuple[torch.Tensor | float, ...]


def land(event: torch.cuda.Event | None, add: GradAdd | None) -> None:
    """On the worker thread: wait for a gradient copy, then add it if it was staged."""
    if event is not None:
        event.synchronize()
    if add is None:
        return
    if add.source is not None:
        add.home.copy_(add.source)
        for f in add.factors:
            add.home.mul_(f)
    add.home.add_(add.staged)
