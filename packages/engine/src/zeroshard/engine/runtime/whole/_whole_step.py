"""`WholeParamStep`: a whole-matrix optimizer's own `step()` on full-shape tensors, each
matrix at its owner ([Note: whole-matrix optimizers] in `_declare.py`).

[Note: whole parameters]
The optimizer steps one `nn.Parameter` per matrix this rank owns (`params`, the same
objects for the whole run, so its state is keyed by them): during `step()` their data
and gradient are the full master and gradient, as views of this rank's shard where
the matrix lies whole in it, else of the owner's buffer the exchange filled; between
steps they hold no memory. Its state (momentum, preconditioners) lives on the owner only,
full-shape, and checkpoints store it by parameter name. Per exchanged element a step
moves the gradient and the master to the owner and the master back, each in the master
dtype (4 bytes each with fp32 masters, 2 with bf16 ones).

[Note: whole parameters offloaded]
A group CPU offload homes on the host keeps its master there, and the state of the
matrices its owners step too, between steps: the step runs on the device all the same
(as Muon's Newton-Schulz does). The group's gradient (read through its destination,
clipping's factors applied) and master go up for the exchange; the optimizer's state
tensors of those matrices go up before its `step()` and come back down after it (its
0-dim tensors, a step count, stay where the optimizer keeps them); each master comes
back down into the host shard and the home's compute shard is rewritten from it. The
bits are the device step's: the same step on the same values. During the step the owner
holds what it steps on the device, as without offload; between steps, nothing of it.
On the host that state is pinned where it goes up to a GPU (`offload.pin_memory`, as
offload's own buffers: `host_state`), so its copies up and down run at the bus's speed
and the copies up do not wait; allocated the first time it comes down, and by a load.
Offload's host-memory check counts it before then, as the planner does: the state a step
allocates on each whole matrix this rank owns (`owned_host_state`, measured by
`OwnerState`), and none per element of the shards.

[Note: whole parameters under tensor parallelism]
A matrix split over tp is a piece on each tp rank, in a flat group sharded over dp with
the same layout on every tp rank, so one dp rank owns its piece on every tp rank ([Note:
Muon under tensor parallelism] in _muon.py). There the pieces of each owned matrix's
gradient and master are all-gathered over tp (one all-gather per group's local, and
per its owned, matrices), every tp rank steps the whole matrix alike (the same input
and ops: the same bits), and each keeps its own piece of the new master. The state is
the whole matrix's, the same on each tp rank of the owner: it needs no splitting, and
a checkpoint keeps one copy of it (written by tp rank 0), which loads at any tp size.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import NamedTuple

import torch
from torch import nn

from zeroshard.engine.runtime._flat_group import FlatParamGroup
from zeroshard.engine.runtime._home import HomeKind, refresh_homes
from zeroshard.engine.runtime._stepper import StepOutcome
from zeroshard.engine.runtime._tensor_parallel import TensorParallel, split_dim
from zeroshard.engine.runtime.whole._exchange import ExchangingStep, MatrixExchange
from zeroshard.partition import Slot, empty_host


def whole_parameters(
    groups: Sequence[FlatParamGroup], exchanges: Mapping[int, MatrixExchange]
) -> dict[str, nn.Parameter]:
    """One empty whole parameter per matrix this rank owns among `groups`' trainable ones
    (by name, in the order their param groups step them: [Note: whole parameters]), on
    the device its step runs on (an offloaded group's too)."""
    return {
        slot.name: nn.Parameter(torch.empty(0, dtype=g.master.dtype, device=g.process_group.device))
        for g in groups
        if g.trainable
        for slot in exchanges[g.index].stepped_here()
    }


def host_state(t: torch.Tensor, device: torch.device, pin_memory: bool) -> torch.Tensor:
    """A host copy of `t`, state of a matrix stepped on `device` that waits on the host
    between steps: pinned where it goes up to a GPU and `pin_memory` (offload.pin_memory)
    asks for it, pageable where pinning fails ([Note: whole parameters offloaded])."""
    host, _ = empty_host(t.numel(), t.dtype, pin=pin_memory and device.type == "cuda")
    return host.view(t.shape).copy_(t)


def on_host(groups: Sequence[FlatParamGroup], exchanges: Mapping[int, MatrixExchange]) -> set[str]:
    """The matrices this rank owns among `groups` whose state lives on the host between
    steps: those of groups CPU offload homes there ([Note: whole parameters offloaded])."""
    return {
        s.name
        for g in groups
        if g.trainable and g.home.kind is HomeKind.HOST
        for s in exchanges[g.index].stepped_here()
    }


class _Matrices(NamedTuple):
    """Matrices of one group that this rank steps (its local ones, or its owned exchanged
    ones): their slots, and views of their master and gradient (pieces under tp)."""

    slots: list[Slot]
    masters: list[torch.Tensor]
    grads: list[torch.Tensor]


class WholeParamStep(ExchangingStep):
    """`optimizer` (whose first param group is the combined optimizer's `offset`-th) on
    whole parameters at their owners; each of `groups` with its exchange in `exchanges`.
    Its param groups hold `params` (by name: one empty whole parameter per matrix this
    rank owns), bound before it is built (`WholeMatrices`, `bind_masters`); matrices split
    over `tensor_parallel` are joined whole for it ([Note: whole parameters under tensor
    parallelism]); the state of offloaded groups' matrices waits on the host, pinned if
    `pin_memory` ([Note: whole parameters offloaded])."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        groups: Sequence[FlatParamGroup],
        exchanges: Mapping[int, MatrixExchange],
        params: Mapping[str, nn.Parameter],
        offset: int,
        tensor_parallel: TensorParallel | None,
        pin_memory: bool,
    ) -> None:
        super().__init__(optimizer, groups, exchanges, offset, tensor_parallel)
        self.params = dict(params)
        self.on_host = on_host(self.groups, self.exchanges)
        self.pin_memory = pin_memory
        # The dim each matrix split over tp is cut along, by name.
        self.splits = {
            n: dim
            for g in self.groups
            for n, p in zip(g.names, g.params, strict=True)
            if (dim := split_dim(p)) is not None
        }

    def step(self) -> StepOutcome:
        """Gradients and masters to the owners, the optimizer's step, masters back."""
        stepped = [g for g in self.groups if g.grad_shard is not None]
        shards = {g.index: _on_device(g) for g in stepped}
        arriving = []
        for g in stepped:
            master, grad = shards[g.index]
            ex = self.exchanges[g.index]
            if ex.active:
                grads, gh = ex.to_owners(grad, label=f"gradients of group {g.index}")
                masters, mh = ex.to_owners(master, label=f"masters of group {g.index}")
                arriving.append((g, grads, masters, (gh, mh)))
        held: list[_Matrices] = []
        for g in stepped:
            master, grad = shards[g.index]
            ex = self.exchanges[g.index]
            slots = [p.slot for p in ex.local]
            held.append(_Matrices(slots, ex.local_views(master), ex.local_views(grad)))
        for g, grads, masters, handles in arriving:
            for h in handles:
                h.wait()
            ex = self.exchanges[g.index]
            held.append(_Matrices(list(ex.owned), ex.views(masters), ex.views(grads)))
        # Each matrix stepped: its slot, the master view it is written back to, and the
        # whole master the optimizer steps (the view itself unless it was joined over tp).
        written: list[tuple[Slot, torch.Tensor, torch.Tensor]] = []
        for m in held:
            wholes = self._whole(m)
            for slot, view, (master, grad) in zip(m.slots, m.masters, wholes, strict=True):
                p = self.params[slot.name]
                p.data, p.grad = master, grad
                written.append((slot, view, master))
        try:
            with self._state_on_device():
                self.optimizer.step()
        finally:
            for p in self.params.values():
                p.data = p.data.new_empty(0)
                p.grad = None
        tp = self.tensor_parallel
        for slot, view, master in written:
            if master is not view:
                assert tp is not None
                view.copy_(tp.own_piece(master, self.splits[slot.name]))
        returning = []
        for g, _, masters, _ in arriving:
            ex = self.exchanges[g.index]
            back = ex.from_owners(masters, label=f"masters of group {g.index}")
            returning.append((g, back))
        for g in stepped:
            # An offloaded group's local matrices were stepped on the device's copy.
            master, _ = shards[g.index]
            if master.data_ptr() != g.master.data_ptr():
                for piece in self.exchanges[g.index].local:
                    end = piece.start + piece.numel
                    g.master.detach()[piece.start : end].copy_(master[piece.start : end])
        for g, (buffer, handle) in returning:
            handle.wait()
            shard = g.master.detach()
            for piece, chunk in self.exchanges[g.index].split_back(buffer):
                shard[piece.start : piece.start + piece.numel].copy_(chunk)
        # What gathers read of a master homed on the host follows it.
        refresh_homes([g for g in stepped if g.home.kind is HomeKind.HOST])
        return StepOutcome.PUBLISH

    def _whole(self, m: _Matrices) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each matrix of `m` whole, its master and gradient: the views themselves, or
        under tp their pieces joined (collective over tp: every tp rank of this dp rank
        joins the same matrices, in the same order)."""
        dims = [self.splits[s.name] for s in m.slots if s.name in self.splits]
        if not dims:
            return list(zip(m.masters, m.grads, strict=True))
        tp = self.tensor_parallel
        assert tp is not None and len(dims) == len(m.slots)  # a split group is split throughout
        joined = tp.whole_tensors([*m.masters, *m.grads], dims + dims)
        n = len(m.slots)
        return list(zip(joined[:n], joined[n:], strict=True))

    @contextmanager
    def _state_on_device(self) -> Iterator[None]:
        """The state of the offloaded matrices this rank owns on the device for the step,
        back on the host after it ([Note: whole parameters offloaded]): each tensor of
        at least one dim, into the host memory it came from."""
        state = self.optimizer.state
        came: dict[tuple[str, str], torch.Tensor] = {}
        for name in self.on_host:
            p = self.params[name]
            kept = state.get(p, {})
            for key, value in kept.items():
                if isinstance(value, torch.Tensor) and value.dim() and value.device != p.device:
                    came[(name, key)] = value
                    kept[key] = value.to(p.device, non_blocking=True)
        try:
            yield
        finally:
            for name in self.on_host:
                p = self.params[name]
                kept = state.get(p, {})
                for key, value in kept.items():
                    if not (isinstance(value, torch.Tensor) and value.dim()):
                        continue
                    if value.device.type == "cpu":
                        continue
                    host = came.get((name, key))
                    if host is None or host.shape != value.shape or host.dtype != value.dtype:
                        kept[key] = host_state(value, p.device, self.pin_memory)
                    else:
                        kept[key] = host.copy_(value)


def _on_device(g: FlatParamGroup) -> tuple[torch.Tensor, torch.Tensor]:
    """`g`'s master and gradient shard on the device the exchange runs on: the device
    home's own, or copies of an offloaded group's (its gradient read through its
    destination, every factor applied: [Note: whole parameters offloaded])."""
    master = g.master.detach()
    if g.home.kind is HomeKind.DEVICE:
        assert g.grad_shard is not None
        return master, g.grad_shard
    device = g.process_group.device
    grad = torch.empty(master.shape, dtype=master.dtype, device=device)
    for start, block in g.grads.read(g):
        grad[start : start + block.numel()].copy_(block)
    return master.to(device), grad
