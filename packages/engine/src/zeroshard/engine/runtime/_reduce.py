"""Gradient reduction for stages 1 and 2: full gradients in, fp32 gradient shards out.

Stage 1 lets autograd accumulate into each group's full `grad_buffer` (parameters'
`.grad` are views of it) and reduce-scatters the buffers when the optimizer needs the
gradients. Stage 2 copies each gradient into its group's bucket the moment it is ready
(a post-accumulate-grad hook), frees the full gradient, and reduce-scatters a group as
soon as it is complete, while backward goes on.

[Note: launch order]
Collectives must be issued in the same order on every rank. Groups are reduced strictly
in `order` (reverse registration, roughly backward order): a group that completes early
waits for the groups before it. At the end of each backward, groups whose gradients did
not all arrive (unused parameters) are reduced too, missing gradients counting as zero,
so every rank issues every group's collective exactly once per backward.

[Note: averaging in the copy]
Stages 2/3 average over the process group by scaling each gradient by 1/size as it is
copied into its bucket (the copy is a pass over it anyway), and the reduce-scatter sums.
That is what NCCL's float average does inside the collective (it multiplies every input
by 1/size before the sum), so the numbers are the same, but the collective has no pass of
its own left: an in-place sum over one rank is no work at all, where an average still
scales every element. Stage 1 reduces its accumulated buffers with the average. A group
of its own given a gradient divide factor is divided by that instead of its size (its
`grad_divisor`: [Note: the gradient divide factor] in setup/_placement.py); stage 1 then
sums, and divides the reduced shard.

[Note: bucket memory]
A bucket is held until its reduce-scatter is waited on. At most
`max_inflight_reductions` are in flight: launching one more first waits on the oldest
and folds it into its fp32 shard, so bucket memory stays bounded by a few groups rather
than growing to the whole model's gradients.
"""

from __future__ import annotations

import weakref
from collections import deque
from collections.abc import Sequence
from typing import Protocol

import torch
from torch import nn

from zeroshard.comm import Group, Handle, ReduceOp
from zeroshard.engine.runtime._casts import cast_into
from zeroshard.engine.runtime._collectives import average_replicas, reduce_scatter_grads
from zeroshard.engine.runtime._flat_group import FlatParamGroup
from zeroshard.engine.runtime._grad_guard import is_guard
from zeroshard.engine.runtime._labels import phase
from zeroshard.engine.runtime._stats import EngineStats
from zeroshard.engine.runtime._tensor_parallel import like_param, local_grad, own_path


class BackwardEvents(Protocol):
    """What stage 3 tells the reducer and hears from it (`_stage3.Stage3Runtime`)."""

    def reduce_order(self) -> Sequence[FlatParamGroup]:
        """The launch order for the next backward (a new object when it changed)."""
        ...

    def grads_ready(self, g: FlatParamGroup) -> None:
        """All of `g`'s gradients are in its bucket (its reduction is queued)."""
        ...

    def backward_done(self) -> None:
        """Every reduction of this backward was launched and waited."""
        ...


class GradReducer:
    """Reduces gradients of `groups` (trainable ones, in launch order) into fp32 shards.

    `replicate` (hybrid sharding) is the group of ranks holding the same shards, averaged
    over after each reduce-scatter (not a group on a process group of its own, which
    holds other values on each replica: [Note: groups of their own beside hybrid sharding
    and tensor parallelism] in setup/_placement.py); each reduced shard then goes to its group's
    `GradDestination`; `events` (stage 3) sets the launch order and hears when groups are
    complete; `stats` counts the reduce-scatters.
    """

    def __init__(
        self,
        groups: Sequence[FlatParamGroup],
        *,
        stage: int,
        reduce_dtype: torch.dtype,
        overlap: bool,
        max_inflight: int,
        replicate: Group | None,
        events: BackwardEvents | None = None,
        stats: EngineStats | None = None,
    ) -> None:
        self.order = [g for g in groups if g.trainable]
        self._order_source: Sequence[FlatParamGroup] = groups
        self.events = events
        self.replicate = replicate
        self.stats = stats
        self.stage = stage
        self.reduce_dtype = reduce_dtype
        self.overlap = overlap
        self.max_inflight = max_inflight
        self._slot_of: dict[nn.Parameter, tuple[FlatParamGroup, int]] = {}
        self._buckets: dict[int, torch.Tensor] = {}
        # Per group in a bucket: the slots written so far ([Note: bucket fill]).
        self._filled: dict[int, list[int]] = {}
        self._gaps = {g.index: _gaps(g) for g in groups if g.trainable}
        self._next = 0
        # (group, reduced shard, whether that is a part of the bucket, handle)
        self._inflight: deque[tuple[FlatParamGroup, torch.Tensor, bool, Handle]] = deque()
        self._callback_queued = False
        # Stage 1: set when autograd has written gradients that are not reduced yet.
        self._stage1_dirty = False
        # The hooks live on the parameters, in C++, where the garbage collector cannot see
        # the cycle parameter -> hook -> reducer -> groups -> parameter: hold the reducer
        # weakly, or a deleted model would never be freed.
        this = weakref.ref(self)

        def on_grad_ready(p: torch.Tensor) -> None:
            reducer = this()
            if reducer is not None:
                reducer._on_grad_ready(p)

        for g in self.order:
            for i, p in enumerate(g.params):
                self._slot_of[p] = (g, i)
                hook = p.register_post_accumulate_grad_hook  # untyped in torch
                hook(on_grad_ready)  # type: ignore[no-untyped-call]

    # -- backward ------------------------------------------------------------------------
    def _on_grad_ready(self, p: torch.Tensor) -> None:
        if not self._callback_queued:
            self._callback_queued = True
            if self.events is not None:
                self._follow(self.events.reduce_order())
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
        if self.stage == 1:
            self._stage1_dirty = True
            return
        g, i = self._slot_of[p]  # type: ignore[index]
        local = local_grad(p)  # a DTensor's: [Note: DTensor parameters]
        assert local is not None
        bucket = self._buckets.get(g.index)
        if bucket is None:
            bucket = self._new_bucket(g, p.device)
        slot = g.layout.slots[i]
        # The average's 1/size (or 1/factor), in the copy ([Note: averaging in the copy]).
        scale = 1.0 / g.grad_divisor
        grad, dst = local.reshape(-1), bucket[slot.offset : slot.end]
        if grad.dtype == dst.dtype:
            torch.mul(grad, scale, out=dst)
        else:
            # A product in the gradient's narrower dtype would round before the wider sum
            # the user asked for (bf16 x 1/3 keeps 8 bits): upcast first, then scale.
            cast_into(dst, grad)
            if scale != 1.0:
                dst.mul_(scale)
        # The full gradient now lives in the bucket: free it (ZeRO-2 keeps no full grads).
        p.grad = None
        filled = self._filled[g.index]
        filled.append(i)
        if self.events is not None and len(filled) == len(g.params):
            self.events.grads_ready(g)
        if self.overlap:
            self._launch_ready()

    def _launch_ready(self) -> None:
        while self._next < len(self.order):
            g = self.order[self._next]
            if len(self._filled.get(g.index, ())) < len(g.params):
                return
            self._launch(g)

    def _new_bucket(self, g: FlatParamGroup, device: torch.device) -> torch.Tensor:
        """[Note: bucket fill] A bucket is not zero-filled: every slot is overwritten by its
        gradient, so only what no gradient writes must be zeroed to add nothing: the
        alignment gaps and the padding now (one foreach op), and the slots of parameters
        whose gradient never arrived when the bucket is launched (`_launch`)."""
        bucket = torch.empty(g.layout.padded_numel, dtype=self.reduce_dtype, device=device)
        gaps = [bucket[a:b] for a, b in self._gaps[g.index]]
        if gaps:
            torch._foreach_zero_(gaps)
        self._buckets[g.index] = bucket
        self._filled[g.index] = []
        return bucket

    def _launch(self, g: FlatParamGroup) -> None:
        bucket = self._buckets.pop(g.index, None)
        filled = self._filled.pop(g.index, [])
        if bucket is None:
            bucket = torch.zeros(
                g.layout.padded_numel, dtype=self.reduce_dtype, device=g.process_group.device
            )
        elif len(filled) < len(g.params):
            # Unused parameters: their slots add nothing ([Note: bucket fill]).
            done = set(filled)
            slots = g.layout.slots
            missing = [bucket[s.offset : s.end] for k, s in enumerate(slots) if k not in done]
            torch._foreach_zero_(missing)
        in_place = self._in_place(g)
        out, handle = self._reduce_scatter(g, bucket, op="sum", in_place=in_place)
        self._inflight.append((g, out, in_place, handle))
        self._next += 1
        while len(self._inflight) > self.max_inflight:
            self._finish_oldest()

    def _reduce_scatter(
        self, g: FlatParamGroup, full: torch.Tensor, *, op: ReduceOp, in_place: bool = False
    ) -> tuple[torch.Tensor, Handle]:
        """Start reducing `full` over `g`'s process group by `op` into this rank's part of
        it (`in_place`), or else into a new shard-sized tensor."""
        with phase("zeroshard::reduce_scatter"):
            out, handle = reduce_scatter_grads(
                g.process_group, full, op=op, in_place=in_place, label=f"grads of group {g.index}"
            )
        if self.stats is not None:
            self.stats.reduced(full.nbytes)
        return out, handle

    def _in_place(self, g: FlatParamGroup) -> bool:
        """[Note: in-place reduce-scatter] Where the reduced shard is only read once, by
        `_fold` (added into the gradient shard, or upcast into it), the reduce-scatter
        writes it into this rank's part of the bucket itself: no shard-sized output is
        allocated per reduction in flight, and NCCL's sum over one rank is no work at all
        in place (a copy otherwise). Where the shard becomes the gradient itself (the
        window's first fp32 shard, `adopt_grad_shard`), it must be new memory, or the
        whole bucket would live on as the gradient; an offloaded shard is copied to the
        host after the wait, so it keeps its own small tensor too. The group's
        `GradDestination` says which."""
        return g.grads.reduces_in_place(g, self.reduce_dtype)

    def _finish_oldest(self) -> None:
        g, out, in_place, handle = self._inflight.popleft()
        handle.wait()
        self._fold(g, out, fresh=not in_place)

    def _fold(self, g: FlatParamGroup, out: torch.Tensor, *, fresh: bool) -> None:
        """Average a reduced shard over the replicas (hybrid) and hand it to the group's
        destination; `fresh`: `out` is new memory nobody else holds (it may become the
        shard)."""
        if self.replicate is not None and own_path(g.key.process_group) is None:
            average_replicas(self.replicate, out, label=f"grads of group {g.index} (replicas)")
        g.grads.receive(g, out, fresh=fresh)

    def _drain(self) -> None:
        """Wait until every destination holds what it received."""
        for destination in {id(g.grads): g.grads for g in self.order}.values():
            destination.drain()

    def _follow(self, groups: Sequence[FlatParamGroup]) -> None:
        """At the start of a backward: reduce in `groups`' order if it changed (the same
        on every rank: it is the recorded forward order, reversed)."""
        if groups is self._order_source:
            return
        assert not self._inflight and self._next == 0
        self._order_source = groups
        self.order = [g for g in groups if g.trainable]

    def _end_of_backward(self) -> None:
        self._callback_queued = False
        if self.stage != 1:
            while self._next < len(self.order):
                self._launch(self.order[self._next])
            while self._inflight:
                self._finish_oldest()
            self._drain()
            self._next = 0
        if self.events is not None:
            self.events.backward_done()

    # -- step ----------------------------------------------------------------------------
    def reduce_pending(self) -> None:
        """Stage 1: reduce-scatter the accumulated full gradients into the fp32 shards."""
        if self.stage != 1 or not self._stage1_dirty:
            return
        pending: list[tuple[FlatParamGroup, torch.Tensor, torch.Tensor, Handle]] = []
        for g in self.order:
            buf = _grad_buffer(g)
            self._repoint_stage1_grads(g, buf)
            full = buf
            if buf.dtype != self.reduce_dtype:
                full = cast_into(torch.empty_like(buf, dtype=self.reduce_dtype), buf)
            # The average, unless the group divides by a factor of its own.
            op: ReduceOp = "avg" if g.grad_divisor == g.process_group.size else "sum"
            pending.append((g, buf, *self._reduce_scatter(g, full, op=op)))
        for g, buf, out, handle in pending:
            handle.wait()
            if g.grad_divisor != g.process_group.size:
                out.div_(g.grad_divisor)
            self._fold(g, out, fresh=True)
            buf.zero_()
        self._drain()
        self._stage1_dirty = False

    @staticmethod
    def _repoint_stage1_grads(g: FlatParamGroup, buf: torch.Tensor) -> None:
        # A user who set `.grad = None` (model.zero_grad()) made autograd allocate fresh
        # gradients outside the buffer: fold them in so nothing is lost, and re-point.
        for p, slot in zip(g.params, g.layout.slots, strict=True):
            view = buf[slot.offset : slot.end]
            # Guarded: its values are in `view`.
            grad = None if is_guard(p.grad) else local_grad(p)
            if grad is None or grad.data_ptr() != view.data_ptr():
                if grad is not None:
                    view.add_(grad.reshape(-1))
                p.grad = like_param(p, view.view(slot.shape))

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Forget all gradients; `set_to_none` frees the shards until the next backward."""
        for g in self.order:
            g.grads.forget(g, set_to_none=set_to_none)
            if g.grad_buffer is not None:
                g.grad_buffer.zero_()
        self._stage1_dirty = False


def _grad_buffer(g: FlatParamGroup) -> torch.Tensor:
    buf = g.grad_buffer
    if buf is None:
        raise RuntimeError(f"flat group {g.index} has no stage-1 gradient buffer")
    return buf


def _gaps(g: FlatParamGroup) -> list[tuple[int, int]]:
    """[start, end) of what no slot of `g` covers: alignment gaps and the end's padding."""
    out: list[tuple[int, int]] = []
    at = 0
    for slot in sorted(g.layout.slots, key=lambda s: s.offset):
        if slot.offset > at:
            out.append((at, slot.offset))
        at = max(at, slot.end)
    if g.layout.padded_numel > at:
        out.append((at, g.layout.padded_numel))
    return out
