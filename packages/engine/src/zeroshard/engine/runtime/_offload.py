"""CPU offload: the fp32 masters, gradients and optimizer state of flat groups on the host.

The offloaded groups' shards are laid end to end in one rank-local "chunk space" cut by a
`ChunkLayout` into fixed-size chunks; every rank holds the same number of chunks of the
same size (flat-group shards are equal on every rank), so every rank moves the same
bytes at the same time and none waits on a larger peer. The host holds, per chunk, the
fp32 master (pageable: it never crosses the bus), the gradient in the reduce dtype
(pinned: gradients land in it straight from the device) and the optimizer state torch
allocates beside each master. Compute-dtype shards go out through pinned memory too.

[Note: offload host memory]
With bf16 gradients an offloaded element costs 4 (master) + 2 (gradient) + the optimizer's
state (AdamW: 8) = 14 bytes: no fp32 gradient of the whole model is ever on the host. The
step upcasts one group's gradient at a time into an fp32 buffer of the largest group
(`grad_fp32`), steps that group and drops it. Clipping and fp16 unscaling do not touch a
gradient in a dtype narrower than fp32 (that would round it): their factors are kept per
group and applied in that upcast, in the order they came, the same fp32 multiplications
the gradient would have had in place. Gradient accumulation in such a dtype must add in
fp32: on the first accumulated micro-step the host allocates an fp32 gradient per chunk
(4 more bytes per element, kept from then on); the group's gradient moves there (its
factors applied) and later micro-steps add into it.

[Note: offload stream order]
Gradients in. A reduce-scatter's output `out` is complete on the current stream once its
handle was waited. `receive` makes the D2H stream wait on the current stream and copies
`out` as it is (the reduce dtype) to the host, then records an event; `out.record_stream`
keeps the allocator from reusing its block before that stream has read it. The first
gradient a group receives since `zero_grad` lands in its host gradient directly: no zero
fill, no add, no host work at all. A later one (gradient accumulation) lands in a pinned
staging slot and one worker thread adds it into the fp32 gradient once the copy's event
completed, while backward goes on (torch ops release the GIL). The worker runs its tasks
in order (each waits on its copy's event first), so an add never reads a copy still in
flight nor races the copy it adds to. A slot is reused only after its add finished; at
most `_MAX_PENDING` copies are outstanding, which bounds the device blocks they hold and
the staging memory. `drain` (end of backward, stage 1's reduction) waits for every copy
and add, so the optimizer, clipping and checkpoints read complete gradients.

Shards out. After a step (or any change of the masters) the compute shards are rewritten
from the masters. The H2D stream waits on the current stream first: gathers issued in the
last step may still read the compute shards on the device; with offload_params,
`begin_upload` synchronizes the current stream, as the CPU rewrites the host copies those
gathers read. Then, chunk by chunk, the CPU casts the master to the compute dtype into a
pinned buffer and the H2D stream copies it to the device and records the chunk's event.
The step uploads a chunk as soon as every group in it was stepped (`stepped`), so the
copy of one chunk overlaps the CPU step of the next groups. A pinned staging slot is
rewritten only after the event of its previous copy completed. A gather or publish of a
group makes the current stream wait on the events of the group's chunks, so nothing reads
a half-copied shard.

With `offload_params` the compute shards stay on the host (pinned) and each gather copies
its group's shard to the device on the current stream just before the all-gather, which
the prefetch order issues ahead of need.

On the CPU (gloo) there are no streams or events: the same calls copy within host memory
and are complete when they return.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass

import torch
from torch import nn

from zeroshard.comm import Group
from zeroshard.engine.runtime._flat_group import FlatParamGroup
from zeroshard.engine.runtime._host_norm import shard_norm
from zeroshard.engine.runtime._offload_io import GradAdd, SideStream, grad_worker, host_tensor, land
from zeroshard.engine.runtime._offload_plan import GRAD_SLOTS, UPLOAD_SLOTS, offload_sizes

# Gradient copies (and adds) outstanding at once; see [Note: offload stream order].
_MAX_PENDING = 4


@dataclass(frozen=True)
class OffloadBytes:
    """Bytes one rank holds for offload: on the host, pinned, and moved per step each way."""

    chunks: int
    host: int
    pinned: int
    h2d_per_step: int


class HostOffload:
    """Host state of the offloaded groups; see [Note: offload stream order]."""

    def __init__(
        self,
        groups: Sequence[FlatParamGroup],
        *,
        shard_group: Group,
        compute_dtype: torch.dtype,
        chunk_bytes: int,
        reduce_dtype: torch.dtype,
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
            reduce_dtype=reduce_dtype,
            offload_params=offload_params,
        )
        self.offset = {g.index: lo for g, lo in zip(self.groups, sizes.offsets, strict=True)}
        self.layout = sizes.chunks
        n, s = self.layout.num_chunks, self.layout.shard_numel
        self.master = torch.zeros(n, s, dtype=torch.float32)
        self._pinned_bytes = 0
        self._host_bytes = self.master.nbytes
        self.grad = self._host(n * s, reduce_dtype, pin).view(n, s)
        # The fp32 gradient of gradient accumulation, made on first use (see the Note);
        # without one (`grad` is fp32 already) accumulation adds into `grad`.
        self._acc: torch.Tensor | None = self.grad if reduce_dtype == torch.float32 else None
        # The step's upcast of one group's gradient; pageable: only the CPU reads it.
        self._upcast = self._host(sizes.grad_slot_numel, torch.float32, False)
        # Clipping / unscaling factors not yet applied to a narrower-than-fp32 gradient.
        self._factors: dict[int, list[torch.Tensor | float]] = {}
        # offload_params: the compute shards live here; else pinned slots stage uploads.
        self.compute_host: torch.Tensor | None = None
        self.compute_dev: torch.Tensor | None = None
        if offload_params:
            self.compute_host = self._host(n * s, compute_dtype, pin).view(n, s)
        else:
            self.compute_dev = torch.zeros(n, s, dtype=compute_dtype, device=self.device)
        self._up = SideStream(self.device)
        self._down = SideStream(self.device)
        self._up_slots = (
            self._slots(UPLOAD_SLOTS, s, compute_dtype, pin) if not offload_params else []
        )
        self._up_busy: deque[tuple[torch.Tensor, torch.cuda.Event | None]] = deque()
        self._free_grad_slots = self._slots(GRAD_SLOTS, sizes.grad_slot_numel, reduce_dtype, pin)
        self._pending: deque[tuple[Future[None], torch.Tensor | None]] = deque()
        self._worker = grad_worker(self.device)
        self._ready: list[torch.cuda.Event | None] = [None] * n
        # Chunk -> groups of this step not yet `stepped` in it (see `begin_upload`).
        self._waiting: dict[int, int] = {}
        # Set while a backward steps each group as its gradient lands (`step_in_backward`).
        self._step_one: Callable[[FlatParamGroup], None] | None = None
        self._main: torch.cuda.Stream | None = None
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
        add = None
        if g.grad_shard is None:
            dst = g.claim_grad_shard()
        else:
            while not self._free_grad_slots:
                self._retire_oldest()
            slot = self._free_grad_slots.pop()
            dst = slot[: out.numel()]
            add = self._accumulate(g, dst)
        with self._down.after_current():
            dst.copy_(out, non_blocking=True)
            event = self._down.event()
        if self._down.stream is not None:
            out.record_stream(self._down.stream)
        future = self._worker.submit(land, event, add)
        self._pending.append((future, slot))
        if self._step_one is not None:
            # The same worker, after the copy (and add): see [Note: offload step pipeline].
            self._pending.append((self._worker.submit(self._step_one, g), None))

    def _accumulate(self, g: FlatParamGroup, staged: torch.Tensor) -> GradAdd:
        """The add of `staged` into `g`'s fp32 gradient, promoting it there the first time."""
        assert g.grad_shard is not None
        if g.grad_shard.dtype == torch.float32:
            return GradAdd(g.grad_shard, staged, None, ())
        if self._acc is None:
            n, s = self.layout.num_chunks, self.layout.shard_numel
            self._acc = self._host(n * s, torch.float32, False).view(n, s)
        source, home = g.grad_shard, self._flat(self._acc, g)
        # Later micro-steps and the step read the fp32 gradient.
        g.grad_shard = home
        return GradAdd(home, staged, source, tuple(self._factors.pop(g.index, ())))

    def _retire_oldest(self) -> None:
        future, slot = self._pending.popleft()
        try:
            future.result()
        finally:
            if slot is not None:
                self._free_grad_slots.append(slot)

    def step_each(self, step_one: Callable[[FlatParamGroup], None] | None) -> None:
        """From now on step each group on the worker as its gradient lands (None: stop)."""
        self._step_one = step_one

    def drain(self) -> None:
        """Wait until every gradient copy has landed and every staged one was added."""
        while self._pending:
            self._retire_oldest()

    # -- shards out ----------------------------------------------------------------------
    def _chunks_of(self, g: FlatParamGroup) -> range:
        s = self.layout.shard_numel
        lo = self.offset[g.index]
        return range(lo // s, -(-(lo + g.layout.shard_numel) // s))

    # -- the step's gradients ------------------------------------------------------------
    def grad_norm(self, g: FlatParamGroup) -> torch.Tensor:
        """The 2-norm of `g`'s gradient as the step will see it (zeros if none arrived), on
        every core ([Note: host gradient norm])."""
        grad = self.grad_fp32(g)
        return torch.zeros(()) if grad is None else shard_norm(grad)

    def scale_grads(self, groups: Sequence[FlatParamGroup], factor: torch.Tensor | float) -> None:
        """Multiply the gradients of `groups` by `factor`: in place where fp32, else when
        the step upcasts them ([Note: offload host memory])."""
        fp32 = [g.grad_shard for g in groups if g.grad_shard is not None]
        fp32 = [t for t in fp32 if t.dtype == torch.float32]
        if fp32:
            torch._foreach_mul_(fp32, factor)
        for g in groups:
            if g.grad_shard is not None and g.grad_shard.dtype != torch.float32:
                self._factors.setdefault(g.index, []).append(factor)

    def forget_grad(self, g: FlatParamGroup) -> None:
        """zero_grad: `g` holds nothing of the next window (its host memory stays)."""
        g.grad_shard = None
        self._factors.pop(g.index, None)

    @torch.no_grad()
    def grad_fp32(self, g: FlatParamGroup) -> torch.Tensor | None:
        """`g`'s gradient in fp32, its factors applied: the fp32 gradient itself, or an
        upcast valid until the next call; None if `g` has none."""
        grad = g.grad_shard
        if grad is None or grad.dtype == torch.float32:
            return grad
        out = self._upcast[: grad.numel()]
        out.copy_(grad)
        for f in self._factors.get(g.index, ()):
            out.mul_(f)
        return out

    # -- shards out ----------------------------------------------------------------------
    def begin_upload(self, groups: Sequence[FlatParamGroup]) -> None:
        """Start rewriting the compute shards of `groups` from their masters: each chunk
        goes up once every group of `groups` in it was `stepped`."""
        self.finish_upload()
        if self.device.type == "cuda":
            # Uploads may be queued from the worker thread: they follow this stream.
            self._main = torch.cuda.current_stream(self.device)
        for g in groups:
            for i in self._chunks_of(g):
                self._waiting[i] = self._waiting.get(i, 0) + 1
        if self._waiting and self.compute_host is not None and self.device.type == "cuda":
            # Gathers issued in the last step may still copy from the host shards (see
            # the Note); device shards are ordered by the upload stream's wait instead.
            torch.cuda.current_stream(self.device).synchronize()

    def stepped(self, g: FlatParamGroup) -> None:
        """`g`'s master is final for this step: upload the chunks that were waiting on it."""
        for i in self._chunks_of(g):
            self._waiting[i] -= 1
            if self._waiting[i] == 0:
                del self._waiting[i]
                self._upload(i)

    def finish_upload(self) -> None:
        """Upload the chunks `begin_upload` named that have not gone yet."""
        for i in sorted(self._waiting):
            self._upload(i)
        self._waiting.clear()

    @torch.no_grad()
    def refresh(self, groups: Sequence[FlatParamGroup]) -> None:
        """Recast the masters of `groups` and upload them (after an edit of the masters)."""
        self.begin_upload(groups)
        self.finish_upload()

    @torch.no_grad()
    def _upload(self, i: int) -> None:
        if self.compute_host is not None:
            self.compute_host[i].copy_(self.master[i])
            return
        slot = self._free_up_slot()
        slot.copy_(self.master[i])
        assert self.compute_dev is not None
        with self._up.after_current(self._main):
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
