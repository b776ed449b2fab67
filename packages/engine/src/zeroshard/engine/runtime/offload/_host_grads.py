"""`HostGrads`: the offloaded groups' gradients on the host, their `GradDestination`.

Reduced shards come down to the host in the reduce dtype, accumulate there in fp32 under
gradient accumulation, and are read back by clipping and the host step with the
clipping / unscaling factors not yet applied to them ([Note: offload host memory] and
[Note: offload stream order] in _host_offload.py).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import Future, wait
from dataclasses import dataclass
from typing import NamedTuple

import torch

from zeroshard.engine.runtime._flat_group import FlatParamGroup
from zeroshard.engine.runtime._host_norm import norm_of_rows, row_norms
from zeroshard.engine.runtime.offload._fused_adam import STEP_BLOCK
from zeroshard.engine.runtime.offload._io import GradAdd, HostMemory, SideStream, grad_worker, land
from zeroshard.engine.runtime.offload._plan import GRAD_STAGING, OffloadSizes
from zeroshard.engine.runtime.offload._step_thread import StepThread

# Gradient copies (and adds) outstanding at once; see [Note: offload stream order].
_MAX_PENDING = 4


class _Passing(NamedTuple):
    """A gradient stepped in backward from a staging slot, until its step finished."""

    step: Future[None]
    slot: torch.Tensor
    group: FlatParamGroup
    grad: torch.Tensor


@dataclass(frozen=True)
class HostGrad:
    """An offloaded group's gradient as its step reads it: the tensor (the reduce dtype or
    fp32) and the clipping / unscaling factors not applied to it yet ([Note: offload host
    memory]). A delayed step holds this while `zero_grad` forgets the group's gradient."""

    tensor: torch.Tensor
    factors: tuple[torch.Tensor | float, ...]


class HostGrads:
    """The host gradients of the offloaded groups (laid out as their masters, at `offset`
    in the chunk space of `sizes`), the copies that bring them down, and what reads them.
    `check(nbytes, what)` raises on every rank where a host cannot hold `nbytes` more (the
    gradients held until `step()`, allocated on first need: [Note: offload host memory])."""

    def __init__(
        self,
        sizes: OffloadSizes,
        offset: Mapping[int, int],
        *,
        device: torch.device,
        pin: bool,
        memory: HostMemory,
        thread: StepThread,
        check: Callable[[int, str], None],
    ) -> None:
        self._offset = offset
        self._numel = dict(zip(offset, sizes.shard_numels, strict=True))
        self._largest = sizes.staging_numel
        self._layout = sizes.chunks
        self._memory = memory
        self._pin = pin
        self._check = check
        # Told of each arrival: it steps groups as they land (step_in_backward) and holds
        # a gradient back until the delayed step in flight is done with its group.
        self._thread = thread
        self._reduce_dtype = sizes.reduce_dtype
        # The gradients held until step(), made when the first one that needs holding
        # arrives (none under step_in_backward without accumulation: see the Note).
        self._held: torch.Tensor | None = None
        # The fp32 gradient of gradient accumulation, made on first use (see the Note);
        # with fp32 gradients accumulation adds into the held ones.
        self._acc: torch.Tensor | None = None
        # The step's fp32 upcast: one block, or one group's where the step is not blocked
        # (grown to that on first need); pageable: only the CPU reads it.
        self._upcast = memory.alloc(sizes.upcast_numel, torch.float32, False)
        # bf16 masters step on a bf16 gradient: the upcast (its factors applied) cast back
        # into this, of the upcast's size (None with fp32 masters).
        self._narrow: torch.Tensor | None = None
        if sizes.master_dtype != torch.float32:
            self._narrow = memory.alloc(sizes.upcast_numel, sizes.master_dtype, False)
        # Clipping / unscaling factors not yet applied to a narrower-than-fp32 gradient.
        self._factors: dict[int, list[torch.Tensor | float]] = {}
        self._down = SideStream(device)
        # The staging slots, made when the first gradient that passes through one arrives
        # (none without step_in_backward or accumulation: see the Note).
        self._staging_made = False
        self._free_staging: list[torch.Tensor] = []
        self._pending: deque[tuple[Future[None], torch.Tensor | None]] = deque()
        # Gradients stepped in backward from a staging slot: each one's step, slot, group
        # and gradient (the slot's part the group holds until it is stepped).
        self._passing: deque[_Passing] = deque()
        self._worker = grad_worker(device)

    def held(self, index: int) -> torch.Tensor:
        """Group `index`'s part of the gradients held until step() (made on first use)."""
        if self._held is None:
            n, s = self._layout.num_chunks, self._layout.shard_numel
            nbytes = n * s * self._reduce_dtype.itemsize
            what = (
                "the offloaded gradients held until step() (2 bytes a parameter in bf16; a "
                "window of one backward under step_in_backward() holds none)"
            )
            self._check(nbytes, what)
            self._held = self._memory.alloc(n * s, self._reduce_dtype, self._pin).view(n, s)
        return self._part(self._held, index)

    @property
    def upcast(self) -> torch.Tensor:
        """The step's fp32 scratch (one block, or one group's)."""
        return self._upcast

    @property
    def narrow(self) -> torch.Tensor | None:
        """With bf16 masters, the scratch the upcast is cast back into for the step (one
        block, or one group's); None with fp32 masters."""
        return self._narrow

    def _part(self, t: torch.Tensor, index: int) -> torch.Tensor:
        lo = self._offset[index]
        return t.view(-1)[lo : lo + self._numel[index]]

    # -- gradients in ----------------------------------------------------------------------
    def reduces_in_place(self, g: FlatParamGroup, reduce_dtype: torch.dtype) -> bool:
        """Never: the shard is copied to the host after the reduce-scatter's wait, so it
        keeps a small tensor of its own rather than the whole bucket."""
        return False

    def receive(self, g: FlatParamGroup, out: torch.Tensor, *, fresh: bool = False) -> None:
        """Take a reduced gradient shard (on the device, complete on the current stream) into
        `g`'s host gradient, without waiting for it (see [Note: offload stream order]);
        `out` is copied, fresh or not."""
        while self._pending and (len(self._pending) >= _MAX_PENDING or self._pending[0][0].done()):
            self._retire_oldest()
        self._thread.arrived(g)
        staged: torch.Tensor | None = None
        passing: torch.Tensor | None = None
        add = None
        if g.grad_shard is None and self._thread.steps_now(g):
            # Stepped as it lands, then dropped: through a slot, not held ([Note: offload
            # host memory]).
            passing = self._slot()
            dst = passing[: out.numel()]
            g.home.grad_shard = dst
        elif g.grad_shard is None:
            dst = g.home.claim_grad_shard()
        else:
            staged = self._slot()
            dst = staged[: out.numel()]
            add = self._accumulate(g, dst)
        with self._down.after_current():
            dst.copy_(out, non_blocking=True)
            event = self._down.event()
        if self._down.stream is not None:
            out.record_stream(self._down.stream)
        future = self._worker.submit(land, event, add)
        self._pending.append((future, staged))
        step = self._thread.landing(g, future)
        if passing is not None:
            assert step is not None
            self._passing.append(_Passing(step, passing, g, dst))

    def _slot(self) -> torch.Tensor:
        """A free staging slot (made on first use), waiting for the oldest add or step in
        backward that holds one to finish."""
        if not self._staging_made:
            nbytes = GRAD_STAGING * self._largest * self._reduce_dtype.itemsize
            what = (
                f"the {GRAD_STAGING} pinned staging slots a gradient stepped as it lands "
                "(step_in_backward) or accumulated passes through, each of the largest "
                "offloaded shard"
            )
            self._check(nbytes, what)
            self._free_staging = [
                self._memory.alloc(self._largest, self._reduce_dtype, self._pin)
                for _ in range(GRAD_STAGING)
            ]
            self._staging_made = True
        while not self._free_staging:
            if self._passing:
                self._retire_passing()
            else:
                self._retire_oldest()
        return self._free_staging.pop()

    def _accumulate(self, g: FlatParamGroup, staged: torch.Tensor) -> GradAdd:
        """The add of `staged` into `g`'s fp32 gradient, promoting it there the first time."""
        assert g.grad_shard is not None
        if g.grad_shard.dtype == torch.float32:
            return GradAdd(g.grad_shard, staged, None, ())
        if self._acc is None:
            n, s = self._layout.num_chunks, self._layout.shard_numel
            self._acc = self._memory.alloc(n * s, torch.float32, False).view(n, s)
        source, home = g.grad_shard, self._part(self._acc, g.index)
        # Later micro-steps and the step read the fp32 gradient.
        g.home.grad_shard = home
        return GradAdd(home, staged, source, tuple(self._factors.pop(g.index, ())))

    def _retire_oldest(self) -> None:
        future, staged = self._pending.popleft()
        try:
            future.result()
        finally:
            if staged is not None:
                self._free_staging.append(staged)

    def _retire_passing(self) -> None:
        """The oldest group stepped from a slot: once stepped (or failed) it holds no
        gradient and its slot is free."""
        p = self._passing.popleft()
        try:
            p.step.result()
        finally:
            self._passed(p)

    def _passed(self, p: _Passing) -> None:
        if p.group.home.grad_shard is p.grad:  # not a later window's gradient
            p.group.home.grad_shard = None
        self._free_staging.append(p.slot)

    def drain(self) -> None:
        """Wait until every gradient copy has landed, every staged one was added and every
        group stepped in backward was stepped (its slot free again)."""
        try:
            while self._pending:
                self._retire_oldest()
            self._thread.drain()
        finally:
            # After a failed step too, no slot is freed while a step still reads it.
            wait([p.step for p in self._passing])
            while self._passing:
                self._passed(self._passing.popleft())

    # -- the step's gradients ------------------------------------------------------------
    def blocks(self, g: FlatParamGroup) -> list[tuple[int, int]]:
        """[lo, hi) of each block of `g`'s shard, in order ([Note: blocked host step])."""
        n = g.layout.shard_numel
        return [(lo, min(n, lo + STEP_BLOCK)) for lo in range(0, n, STEP_BLOCK)]

    def host_grad(self, g: FlatParamGroup) -> HostGrad | None:
        """`g`'s gradient of this window with its pending factors; None if none arrived."""
        if g.grad_shard is None:
            return None
        return HostGrad(g.grad_shard, tuple(self._factors.get(g.index, ())))

    @torch.no_grad()
    def grad_block(self, grad: HostGrad, lo: int, hi: int) -> torch.Tensor:
        """Elements [lo, hi) of `grad` in fp32, its factors applied: a view of the fp32
        gradient itself, or an upcast valid until the next call."""
        if grad.tensor.dtype == torch.float32:
            return grad.tensor[lo:hi]
        out = self._upcast[: hi - lo]
        out.copy_(grad.tensor[lo:hi])
        for f in grad.factors:
            out.mul_(f)
        return out

    def read(self, g: FlatParamGroup) -> Iterator[tuple[int, torch.Tensor]]:
        """`g`'s gradient block by block, each in fp32 with its factors applied (valid until
        the next block is taken: they share the upcast)."""
        grad = self.host_grad(g)
        if grad is None:
            return
        for lo, hi in self.blocks(g):
            yield lo, self.grad_block(grad, lo, hi)

    def norms(self, groups: Sequence[FlatParamGroup]) -> list[torch.Tensor]:
        """Each group's norm, one group upcast at a time ([Note: offload host memory])."""
        return [self.grad_norm(g) for g in groups]

    def grad_norm(self, g: FlatParamGroup) -> torch.Tensor:
        """The 2-norm of `g`'s gradient as the step will see it (zeros if none arrived), on
        every core, block by block ([Note: host gradient norm])."""
        grad = self.host_grad(g)
        if grad is None:
            return torch.zeros(())
        rows = [row_norms(self.grad_block(grad, lo, hi)) for lo, hi in self.blocks(g)]
        return norm_of_rows(rows)

    def scale(self, groups: Sequence[FlatParamGroup], factor: torch.Tensor | float) -> None:
        """Multiply the gradients of `groups` by `factor`: in place where fp32, else when
        the step upcasts them ([Note: offload host memory])."""
        if isinstance(factor, torch.Tensor):
            factor = factor.cpu()
        fp32 = [g.grad_shard for g in groups if g.grad_shard is not None]
        fp32 = [t for t in fp32 if t.dtype == torch.float32]
        if fp32:
            torch._foreach_mul_(fp32, factor)
        for g in groups:
            if g.grad_shard is not None and g.grad_shard.dtype != torch.float32:
                self._factors.setdefault(g.index, []).append(factor)

    def forget(self, g: FlatParamGroup, *, set_to_none: bool) -> None:
        """zero_grad: `g` holds nothing of the next window; both ways its host memory stays
        (the next gradient overwrites it, no zero fill)."""
        g.home.grad_shard = None
        self._factors.pop(g.index, None)

    @torch.no_grad()
    def grad_fp32(self, g: FlatParamGroup) -> torch.Tensor | None:
        """`g`'s whole gradient in fp32, its factors applied (the step outside [Note:
        blocked host step]): the fp32 gradient itself, or an upcast valid until the next
        call; None if `g` has none."""
        grad = self.host_grad(g)
        if grad is None or grad.tensor.dtype == torch.float32:
            return None if grad is None else grad.tensor
        if self._upcast.numel() < grad.tensor.numel():
            # Planned as one block (the optimizer steps in blocks) but this step is not.
            self._memory.drop(self._upcast)
            self._upcast = self._memory.alloc(self._largest, torch.float32, False)
        return self.grad_block(grad, 0, grad.tensor.numel())
