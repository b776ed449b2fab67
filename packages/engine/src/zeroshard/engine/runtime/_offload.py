"""CPU offload: the fp32 masters, gradients and optimizer state of flat groups on the host.

The offloaded groups' shards are laid end to end in one rank-local "chunk space" cut by a
`ChunkLayout` into fixed-size chunks; every rank holds the same number of chunks of the
same size (flat-group shards are equal on every rank), so every rank moves the same
bytes at the same time and none waits on a larger peer. The host holds, per chunk, the
fp32 master (pageable: it never crosses the bus), the fp32 gradient (pinned: gradients
land in it straight from the device) and the optimizer state torch allocates beside each
master. Compute-dtype shards go out through pinned memory too.

[Note: offload stream order]
Gradients in. A reduce-scatter's output `out` is complete on the current stream once its
handle was waited. `receive` makes the D2H stream wait on the current stream, upcasts
`out` to fp32 there (on the device: the host never converts) and copies it to the host,
then records an event; `out.record_stream` keeps the allocator from reusing its block
before that stream has read it. The first gradient a group receives since `zero_grad`
lands in its fp32 host gradient directly, overwriting it: no zero fill, no add, no host
work at all. A later one (gradient accumulation) lands in a pinned fp32 staging slot and
one worker thread adds it into the host gradient once the copy's event completed, while
backward goes on (torch ops release the GIL). The worker runs its tasks in order (each
waits on its copy's event first), so an add never reads a copy still in flight nor races
the overwrite of the same gradient. A slot is reused only after its add finished; at most
`_MAX_PENDING` copies are outstanding, which bounds the device blocks they hold and the
staging memory. `drain` (end of backward, stage 1's reduction) waits for every copy and
add, so the optimizer, clipping and checkpoints read complete gradients.

Shards out. After a step (or any change of the masters) `refresh` first synchronizes the
current stream: gathers issued in the last step may still read the compute shards on the
device, or (offload_params) their host copies. Then, chunk by chunk, the CPU casts the
master to the compute dtype into a pinned buffer and the H2D stream copies it to the
device and records the chunk's event. A pinned staging slot is rewritten only after the
event of its previous copy completed. A gather or publish of a group makes the current
stream wait on the events of the group's chunks, so the upload overlaps the step's
remaining casts and the next forward, and nothing reads a half-copied shard.

With `offload_params` the compute shards stay on the host (pinned) and each gather copies
its group's shard to the device on the current stream just before the all-gather, which
the prefetch order issues ahead of need.

On the CPU (gloo) there are no streams or events: the same calls copy within host memory
and are complete when they return.
"""

from __future__ import annotations

import contextlib
from collections import deque
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch
from torch import nn

from zeroshard.comm import Group, warn_tagged
from zeroshard.engine.runtime._flat_group import FlatParamGroup
from zeroshard.engine.runtime._offload_plan import GRAD_SLOTS, UPLOAD_SLOTS, offload_sizes
from zeroshard.partition import empty_host

_warned_pageable = False
# Gradient copies (and adds) outstanding at once; see [Note: offload stream order].
_MAX_PENDING = 4


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


@dataclass(frozen=True)
class OffloadBytes:
    """Bytes one rank holds for offload: on the host, pinned, and moved per step each way."""

    chunks: int
    host: int
    pinned: int
    h2d_per_step: int


class _Stream:
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

    def event(self) -> torch.cuda.Event | None:
        """An event recorded on this stream now (None on the CPU)."""
        if self.stream is None:
            return None
        ev = torch.cuda.Event()  # type: ignore[no-untyped-call]
        ev.record(self.stream)
        return ev


def _grad_worker(device: torch.device) -> ThreadPoolExecutor:
    """The one thread that waits on gradient copies and adds staged gradients."""
    if device.type != "cuda":
        return ThreadPoolExecutor(1, "zeroshard-offload-grads")
    # It waits on CUDA events: make this rank's device its current one, not device 0
    # (where a first CUDA call would otherwise create a context).
    return ThreadPoolExecutor(
        1, "zeroshard-offload-grads", initializer=torch.cuda.set_device, initargs=(device,)
    )


def _land(
    event: torch.cuda.Event | None, home: torch.Tensor | None, staged: torch.Tensor | None
) -> None:
    """On the worker thread: wait for a gradient copy, then add it to `home` if it was staged."""
    if event is not None:
        event.synchronize()
    if staged is not None:
        assert home is not None
        home.add_(staged)


class HostOffload:
    """Host state of the offloaded groups; see [Note: offload stream order]."""

    def __init__(
        self,
        groups: Sequence[FlatParamGroup],
        *,
        shard_group: Group,
        compute_dtype: torch.dtype,
        chunk_bytes: int,
        pin: bool,
        offload_params: bool,
    ) -> None:
        self.groups = list(groups)
        self.device = shard_group.device
        # Pinning only speeds up copies to a GPU; on the CPU there is no bus to cross.
        pin = pin and self.device.type == "cuda"
        sizes = offload_sizes(
            [g.layout.shard_numel for g in self.groups],
            shard_group.size,
            chunk_bytes=chunk_bytes,
            compute_dtype=compute_dtype,
            offload_params=offload_params,
        )
        self.offset = {g.index: lo for g, lo in zip(self.groups, sizes.offsets, strict=True)}
        self.layout = sizes.chunks
        n, s = self.layout.num_chunks, self.layout.shard_numel
        self.master = torch.zeros(n, s, dtype=torch.float32)
        self._pinned_bytes = 0
        self._host_bytes = self.master.nbytes
        self.grad = self._host(n * s, torch.float32, pin).view(n, s)
        # offload_params: the compute shards live here; else pinned slots stage uploads.
        self.compute_host: torch.Tensor | None = None
        self.compute_dev: torch.Tensor | None = None
        if offload_params:
            self.compute_host = self._host(n * s, compute_dtype, pin).view(n, s)
        else:
            self.compute_dev = torch.zeros(n, s, dtype=compute_dtype, device=self.device)
        self._up = _Stream(self.device)
        self._down = _Stream(self.device)
        self._up_slots = (
            self._slots(UPLOAD_SLOTS, s, compute_dtype, pin) if not offload_params else []
        )
        self._up_busy: deque[tuple[torch.Tensor, torch.cuda.Event | None]] = deque()
        # fp32: the device upcasts before the copy (see the Note).
        self._free_grad_slots = self._slots(GRAD_SLOTS, sizes.grad_slot_numel, torch.float32, pin)
        self._pending: deque[tuple[Future[None], torch.Tensor | None]] = deque()
        self._worker = _grad_worker(self.device)
        self._ready: list[torch.cuda.Event | None] = [None] * n
        for g in self.groups:
            self._adopt(g)

    def _host(self, numel: int, dtype: torch.dtype, pin: bool) -> torch.Tensor:
        t, pinned = host_tensor(numel, dtype, pin=pin)
        self._host_bytes += t.nbytes
        self._pinned_bytes += t.nbytes if pinned else 0
        return t

    def _slots(self, count: int, numel: int, dtype: torch.dtype, pin: bool) -> list[torch.Tensor]:
        return [self._host(numel, dtype, pin) for _ in range(count)]

    def _flat(self, t: torch.Tensor, g: FlatParamGroup) -> torch.Tensor:
        lo = self.offset[g.index]
        return t.view(-1)[lo : lo + g.layout.shard_numel]

    @torch.no_grad()
    def _adopt(self, g: FlatParamGroup) -> None:
        """Move `g`'s master to its host view; its gradient shard and compute shard follow."""
        host = self._flat(self.master, g)
        host.copy_(g.master.detach())
        # The device master is dropped here; the optimizer is built on the host one.
        g.master = nn.Parameter(host, requires_grad=g.trainable)
        g.grad_home = self._flat(self.grad, g)
        g.offload = self

    # -- gradients in --------------------------------------------------------------------
    def receive(self, g: FlatParamGroup, out: torch.Tensor) -> None:
        """Take a reduced gradient shard (on the device, complete on the current stream) into
        `g`'s fp32 host gradient, without waiting for it (see [Note: offload stream order])."""
        while self._pending and (len(self._pending) >= _MAX_PENDING or self._pending[0][0].done()):
            self._retire_oldest()
        slot: torch.Tensor | None = None
        if g.grad_shard is None:
            dst = g.claim_grad_shard()
        else:
            while not self._free_grad_slots:
                self._retire_oldest()
            slot = self._free_grad_slots.pop()
            dst = slot[: out.numel()]
        with self._down.after_current():
            dst.copy_(out.to(torch.float32), non_blocking=True)
            event = self._down.event()
        if self._down.stream is not None:
            out.record_stream(self._down.stream)
        staged = None if slot is None else dst
        future = self._worker.submit(_land, event, g.grad_shard, staged)
        self._pending.append((future, slot))

    def _retire_oldest(self) -> None:
        future, slot = self._pending.popleft()
        try:
            future.result()
        finally:
            if slot is not None:
                self._free_grad_slots.append(slot)

    def drain(self) -> None:
        """Wait until every gradient copy has landed and every staged one was added."""
        while self._pending:
            self._retire_oldest()

    # -- shards out ----------------------------------------------------------------------
    def _chunks_of(self, g: FlatParamGroup) -> range:
        s = self.layout.shard_numel
        lo = self.offset[g.index]
        return range(lo // s, -(-(lo + g.layout.shard_numel) // s))

    @torch.no_grad()
    def refresh(self, groups: Sequence[FlatParamGroup]) -> None:
        """Recast the masters of `groups` and upload them (after a step or an edit)."""
        chunks = sorted({i for g in groups for i in self._chunks_of(g)})
        if not chunks:
            return
        if self.device.type == "cuda":
            # Earlier gathers may still read the compute shards (see the Note).
            torch.cuda.current_stream(self.device).synchronize()
        for i in chunks:
            if self.compute_host is not None:
                self.compute_host[i].copy_(self.master[i])
                continue
            slot = self._free_up_slot()
            slot.copy_(self.master[i])
            assert self.compute_dev is not None
            with self._up.after_current():
                self.compute_dev[i].copy_(slot, non_blocking=True)
                self._ready[i] = self._up.event()
            self._up_busy.append((slot, self._ready[i]))

    def _free_up_slot(self) -> torch.Tensor:
        if len(self._up_busy) == len(self._up_slots):
            slot, event = self._up_busy.popleft()
            if event is not None:
                event.synchronize()
            return slot
        used = {id(s) for s, _ in self._up_busy}
        return next(s for s in self._up_slots if id(s) not in used)

    def compute_shard(self, g: FlatParamGroup) -> torch.Tensor:
        """`g`'s compute-dtype shard on the device, ready for the current stream to read."""
        if self.compute_host is not None:
            host = self._flat(self.compute_host, g)
            return host.to(self.device, non_blocking=host.is_pinned())
        if self.device.type == "cuda":
            current = torch.cuda.current_stream(self.device)
            for i in self._chunks_of(g):
                event = self._ready[i]
                if event is not None:
                    current.wait_event(event)
        assert self.compute_dev is not None
        return self._flat(self.compute_dev, g)

    def nbytes(self) -> OffloadBytes:
        """What this rank holds and moves (equal on every rank: the chunks are even)."""
        n, s = self.layout.num_chunks, self.layout.shard_numel
        compute = self.compute_host if self.compute_host is not None else self.compute_dev
        assert compute is not None
        return OffloadBytes(n, self._host_bytes, self._pinned_bytes, n * s * compute.element_size())
