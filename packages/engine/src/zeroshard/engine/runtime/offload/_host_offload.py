"""CPU offload: the masters, gradients and optimizer state of flat groups on the host.

The offloaded groups' shards are laid end to end in one rank-local "chunk space" cut by a
`ChunkLayout` into fixed-size chunks; every rank holds the same number of chunks of the
same size (flat-group shards are equal on every rank), so every rank moves the same
bytes at the same time and none waits on a larger peer. The host holds, per chunk, the
master (pinned: it goes up to the device, which casts it; pageable with offload_params,
where it never crosses the bus, unless it is in the compute dtype and so is the compute
shard the gathers upload: [Note: offload upload] in _upload.py), the gradient in the
reduce dtype while it is held (pinned: gradients land in it straight from the device)
and the optimizer state torch allocates beside each master.

[Note: offload host memory]
With bf16 gradients an offloaded element costs 4 (master) + 2 (gradient) + the optimizer's
state (AdamW: 8) = 14 bytes: no fp32 gradient of the whole model is ever on the host. With
bf16 masters and offload_params under `step_in_backward`, 2 (the master, which is the
compute shard) + 4 (AdamW's bf16 moments) = 6. The gradients are held until `step()`
only where something reads them then: they are allocated (after the same host-memory
check as `initialize`'s, on every rank) when the first gradient that needs holding
arrives. Under `step_in_backward` a group that the stepping thread steps as its
gradient lands needs none: its fresh gradient lands in one of the `GRAD_STAGING` pinned
slots (made, after the same check, when the first gradient that passes through one
arrives: without step_in_backward or accumulation none is), is stepped from there, and
the group then holds no gradient (`full_grad` gives
None, as torch's optimizer-in-backward drops `.grad`; clipping after such a backward is
refused anyway: the global norm needs every gradient before any step). A receive that
finds no slot free waits for the oldest step, which bounds how far the CPU step may fall
behind backward to the slots. Gradient accumulation (an earlier micro-step's backward,
outside `step_in_backward`), a step at `step()` and groups stepped only then (a
whole-matrix optimizer's, beside `step_in_backward`) hold them. With
torch's fused Adam/AdamW the step upcasts one block of a group's gradient at a time into
one fp32 block (`grad_block`, [Note: blocked host step] in _fused_adam.py); the clip norm
reads the same blocks. Any other optimizer steps a group at a time on its whole upcast,
in an fp32 buffer of the largest group (`grad_fp32`). Clipping and fp16 unscaling do not touch a
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
gradient a group receives since `zero_grad` lands in its host gradient directly (or in a
staging slot, stepped in backward: [Note: offload host memory]): no zero fill, no add, no
host work at all. A later one (gradient accumulation) lands in a pinned
staging slot and one worker thread adds it into the fp32 gradient once the copy's event
completed, while backward goes on (torch ops release the GIL). The worker runs its tasks
in order (each waits on its copy's event first), so an add never reads a copy still in
flight nor races the copy it adds to. A slot is reused only after its add (or step) finished; at
most `_MAX_PENDING` copies are outstanding, which bounds the device blocks they hold and
the staging memory. `drain` (end of backward, stage 1's reduction) waits for every copy
and add, so the optimizer, clipping and checkpoints read complete gradients.

Shards out. After a step (or any change of the masters) the compute shards are rewritten
from the masters. The H2D stream waits on the current stream as of `begin_upload` first:
gathers issued before may still read the compute shards on the device ([Note: upload
stream order] in _upload.py); with offload_params,
`begin_upload` synchronizes the current stream, as the CPU rewrites the host copies those
gathers read. The step says which blocks of masters it finished (`written`); as soon as
all of a chunk is final the H2D stream copies its masters to the device, casts them
there and records its event, so the copy of one chunk overlaps the CPU step of the next
([Note: offload upload] in _upload.py). A gather or publish of a group makes the
current stream wait on the events of the group's chunks, so nothing reads a half-copied
shard.

With `offload_params` the compute shards stay on the host (pinned) and each gather copies
its group's shard to the device on the current stream just before the all-gather, which
the prefetch order issues ahead of need; where they are the masters, what writes the
masters first waits for those copies ([Note: masters read by gathers] in _upload.py).

On the CPU (gloo) there are no streams or events: the same calls copy within host memory
and are complete when they return.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from zeroshard.engine.runtime._flat_group import FlatParamGroup
from zeroshard.engine.runtime._home import Home, HomeKind
from zeroshard.engine.runtime.offload._blocks import BlockedStep
from zeroshard.engine.runtime.offload._compiled_step import coefficients, scale_of, step_piece
from zeroshard.engine.runtime.offload._fused_adam import FusedAdam
from zeroshard.engine.runtime.offload._host_grads import HostGrad, HostGrads
from zeroshard.engine.runtime.offload._io import HostMemory
from zeroshard.engine.runtime.offload._plan import OffloadSizes
from zeroshard.engine.runtime.offload._step_thread import StepThread
from zeroshard.engine.runtime.offload._upload import ShardUpload


@dataclass(frozen=True)
class OffloadBytes:
    """Bytes one rank holds for offload (on the host, pinned of those, on the device: the
    compute shards and their staging chunk) and sends up per step (the masters,
    or with offload_params the compute shards)."""

    chunks: int
    host: int
    pinned: int
    device: int
    h2d_per_step: int


class HostOffload:
    """Host state of the offloaded groups: their masters, their gradients (`grads`, their
    `GradDestination`), the upload of their compute shards and their host step; the
    builder of their homes (`build`) and what those share (a `HomeStore`); see [Note:
    offload stream order]."""

    def __init__(
        self,
        sizes: OffloadSizes,
        indices: Sequence[int],
        *,
        device: torch.device,
        pin: bool,
        check: Callable[[int, str], None],
        compiled_step: bool = False,
    ) -> None:
        """Allocate the host storage of `sizes` for the flat groups `indices` (in chunk-space
        order); each group takes its part when its home is built (`build`). `check(nbytes,
        what)` raises on every rank where a host cannot hold `nbytes` more (before the
        gradients held until `step()` are allocated, on first need)."""
        self.device = device
        # Pinning only speeds up copies to a GPU; on the CPU there is no bus to cross.
        pin = pin and self.device.type == "cuda"
        offload_params = sizes.offload_params
        self.offset = dict(zip(indices, sizes.offsets, strict=True))
        self._numel = dict(zip(indices, sizes.shard_numels, strict=True))
        self.layout = sizes.chunks
        n, s = self.layout.num_chunks, self.layout.shard_numel
        self._memory = HostMemory()
        # Pinned where the masters go up to be cast on the device ([Note: offload upload]
        # in _upload.py) or are the compute shards the gathers upload; else, with
        # offload_params, they never cross the bus.
        master_pinned = pin and (not offload_params or sizes.masters_are_shards)
        self.master = self._memory.alloc(n * s, sizes.master_dtype, master_pinned).view(n, s)
        # The thread that steps groups beside the main thread (step_in_backward,
        # delay_param_update).
        self.step_thread = StepThread(self.device)
        # The offloaded groups' GradDestination: their gradients on the host.
        self.grads = HostGrads(
            sizes,
            self.offset,
            device=device,
            pin=pin,
            memory=self._memory,
            thread=self.step_thread,
            check=check,
        )
        self._blocked = BlockedStep()
        # offload.compiled_step: each group in one compiled pass per chunk ([Note: compiled
        # host step] in _compiled_step.py).
        self._compiled = compiled_step
        self._out = ShardUpload(
            self.master,
            sizes.used_numel,
            self.device,
            sizes.compute_dtype,
            pin=pin,
            offload_params=offload_params,
            alloc=self._memory.alloc,
        )
        # The compute shards are made from the masters as the groups hand them over
        # (`build`): each chunk goes up once every master in it is in place.
        self._out.begin([(lo, lo + self._numel[i]) for i, lo in self.offset.items()])

    def build(self, index: int, shard: torch.Tensor, requires_grad: bool) -> HostHome:
        """The home of offloaded flat group `index`: its part of the host storage, holding
        `shard`'s values (this rank's part of its flat buffer, on the device) as its
        master; its compute shard goes up with the chunks it completes."""
        master = nn.Parameter(self._take_master(index, shard), requires_grad)
        return HostHome(self, index, master)

    def holds(self, g: FlatParamGroup) -> bool:
        """Whether `g` is one of the offloaded groups."""
        return g.index in self.offset

    def _part(self, t: torch.Tensor, index: int) -> torch.Tensor:
        lo = self.offset[index]
        return t.view(-1)[lo : lo + self._numel[index]]

    @torch.no_grad()
    def _take_master(self, index: int, shard: torch.Tensor) -> torch.Tensor:
        """Copy group `index`'s first master (`shard`, on the device) into its host view,
        and send its compute shard up with the chunks it completes."""
        host = self._part(self.master, index)
        host.copy_(shard)
        lo = self.offset[index]
        self._out.written(lo, lo + self._numel[index])
        return host

    def step_blocked(
        self, g: FlatParamGroup, adam: FusedAdam, state: dict[str, Any], grad: HostGrad
    ) -> None:
        """Step `g` (its state's step count advanced) on `grad` block by block, casting each
        block for the upload as it goes ([Note: blocked step loop] in _blocks.py),
        or chunk by chunk in one compiled pass with offload.compiled_step."""
        if self._compiled:
            self._step_compiled(g, adam, state, grad)
            return
        base = self.offset[g.index]

        def written(lo: int, hi: int, src: torch.Tensor) -> None:
            self._out.written(base + lo, base + hi, src)

        scratch = (self.grads.upcast, self.grads.narrow)
        self._blocked.step(
            g.index, adam, state, g.master, grad.tensor, grad.factors, scratch, written
        )

    def _step_compiled(
        self, g: FlatParamGroup, adam: FusedAdam, state: dict[str, Any], grad: HostGrad
    ) -> None:
        """[Note: compiled host step]: one pass per piece of `g` cut at upload chunks; with
        offload_params its cast written straight into the host shards."""
        names = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")[: 3 if adam.amsgrad else 2]
        master = g.master.detach().view(-1)
        moments = [state[k].view(-1) for k in names]
        source = grad.tensor.view(-1)
        coef = coefficients(adam, float(state["step"]))
        scale = scale_of(grad.factors)
        base, s, n = self.offset[g.index], self.layout.shard_numel, g.layout.shard_numel
        lo = 0
        while lo < n:
            hi = min(n, ((base + lo) // s + 1) * s - base)
            out = self._out.target(base + lo, base + hi)
            piece = [t[lo:hi] for t in moments]
            step_piece(adam, coef, scale, master[lo:hi], source[lo:hi], piece, out)
            self._out.written(base + lo, base + hi, cast=False)
            lo = hi

    def forget_state(self) -> None:
        """The optimizer's state is about to be replaced (a state dict loaded)."""
        self._blocked.forget()

    # -- shards out ----------------------------------------------------------------------
    def begin_upload(self, groups: Sequence[FlatParamGroup]) -> None:
        """Start rewriting the compute shards of `groups` from their masters ([Note:
        offload upload] in _upload.py)."""
        lo = [self.offset[g.index] for g in groups]
        self._out.begin([(a, a + g.layout.shard_numel) for a, g in zip(lo, groups, strict=True)])

    def written(self, g: FlatParamGroup, lo: int, hi: int) -> None:
        """Elements [lo, hi) of `g`'s master are final for this step (with offload_params
        cast into the host shards now)."""
        base = self.offset[g.index]
        self._out.written(base + lo, base + hi)

    def stepped(self, g: FlatParamGroup) -> None:
        """All of `g`'s master is final for this step (block by block, as `written`)."""
        for lo, hi in self.grads.blocks(g):
            self.written(g, lo, hi)

    def finish_upload(self) -> None:
        """Upload the chunks `begin_upload` named that have not gone yet."""
        self._out.finish()

    def settle_reads(self) -> None:
        """Before the masters are written outside a step: wait for the gathers' copies
        still reading them, where they are the compute shards ([Note: masters read by
        gathers] in _upload.py)."""
        self._out.settle_reads()

    @torch.no_grad()
    def refresh(self, groups: Sequence[FlatParamGroup]) -> None:
        """`HomeStore`: recast the masters of `groups` and upload them (after an edit of
        the masters outside a step)."""
        self.begin_upload(groups)
        self.finish_upload()

    @property
    def compute_host(self) -> torch.Tensor | None:
        """offload_params: the compute shards, on the host."""
        return self._out.compute_host

    @property
    def compute_dev(self) -> torch.Tensor | None:
        """Without offload_params: the compute shards, on the device."""
        return self._out.compute_dev

    def compute_shard(self, index: int) -> torch.Tensor:
        """Group `index`'s compute-dtype shard on the device (the device's copy, or with
        offload_params the host's, sent up first), ready for the current stream to read."""
        lo = self.offset[index]
        return self._out.shard(lo, lo + self._numel[index])

    def nbytes(self) -> OffloadBytes:
        """What this rank holds and moves (equal on every rank: the chunks are even)."""
        n, s = self.layout.num_chunks, self.layout.shard_numel
        up = self._out.compute_dtype if self.compute_host is not None else self.master.dtype
        up_bytes = up.itemsize
        device = self._out.device_nbytes
        memory = self._memory
        return OffloadBytes(n, memory.host_bytes, memory.pinned_bytes, device, n * s * up_bytes)


class HostHome(Home):
    """An offloaded flat group's part of the host storage: its master lives on the host,
    its gradient goes there (kept between steps in the reduce dtype), and its gathers
    read the compute shard the host keeps for the device."""

    kind = HomeKind.HOST

    def __init__(self, offload: HostOffload, index: int, master: nn.Parameter) -> None:
        super().__init__(master, offload.grads, offload)
        self._offload, self._index = offload, index

    def compute_shard(self) -> torch.Tensor:
        """The compute shard of the master, on the device."""
        return self._offload.compute_shard(self._index)

    def claim_grad_shard(self) -> torch.Tensor:
        """The group's part of the gradients held until `step()` (made on first use: [Note:
        offload host memory]), NOT zeroed: memory kept between steps, where holding no
        gradient of this window is `grad_shard is None`, so zero_grad never touches it;
        never `master.grad`."""
        assert self.grad_shard is None
        self.grad_shard = self._offload.grads.held(self._index)
        return self.grad_shard

    def adopt_grad_shard(self, reduced: torch.Tensor) -> bool:
        """Never: the gradient lives in the host's own memory."""
        return False
