"""`MuonStep`: torch.optim.Muon on sharded masters, each matrix orthogonalized once, by
its owner ([Note: whole-matrix optimizers] in `_declare.py`).

[Note: Muon's step, split]
torch's Muon, per matrix: `buf.lerp_(grad, 1 - momentum)`; `update = grad.lerp(buf,
momentum)` (Nesterov) or `buf`; `O = NS(update)`, whose first act is a cast to bf16;
`param.mul_(1 - lr * weight_decay)`; `param.add_(O, alpha=-adjusted_lr)`. All but NS
are elementwise, so every rank runs them on its own shard, in the same order, and the
momentum stays sharded like AdamW's moments (one fp32 tensor shaped like the master, in
`optimizer.state[master]["momentum_buffer"]`, checkpointed as any shard state). Only the
update crosses ranks: cast to bf16 on each rank (the same bits as NS's own cast), sent
to the owner, orthogonalized there by torch's own function, and sent back in bf16 (what
NS returns). Per exchanged element that is 2 bytes to the owner and 2 back.

Once per `step()`: the gradient it reads is the window's accumulated, reduced one.

A group CPU offload homes on the host keeps its master and momentum there: the
elementwise parts run on the host (the gradient read block by block through its
destination, its clipping factors applied), only the bf16 update goes up to the device
for the exchange and Newton-Schulz, the orthogonalized update comes back down to be added,
and the home's compute shard is rewritten from the stepped master afterwards. The bits
are the device step's: the same elementwise ops on the same values.

[Note: Muon's host transfers]
A host group's step crosses the bus twice: its bf16 update goes up, its orthogonalized
matrices come down. Neither copy makes the host wait on the device's queue per matrix:
the update is written into pinned memory (torch's caching host allocator keeps the block
until the copy has read it) and sent with `non_blocking`; a group's orthogonalized
matrices come down together, into one pinned buffer behind one event (`_Down`), which
the host waits for only once it has computed the next group's momentum and update, so
Newton-Schulz on the device runs beside the host's elementwise passes. Each group's adds
still follow its weight decay and all are in before the compute shards are rewritten:
the same ops on the same values, one wait per group where there was one per matrix and
one per update (a copy from pageable memory waits for the device's queue). On the CPU
(gloo) nothing crosses a bus: no copy, and the adds follow at once.

[Note: Muon under tensor parallelism]
A matrix split over tp is a piece on each tensor-parallel rank, in a flat group of its
own sharded over dp with the same layout on every tp rank; so the same dp rank owns the
piece on every tp rank, and the owners of one matrix's pieces are one tp group. There
each update piece is all-gathered over tp (one all-gather per flat group and phase),
the whole matrix orthogonalized on every rank of that tp group alike (the same bits: the
same input and ops), and each keeps its own piece: Megatron's "duplicated" tensor-parallel
Muon, tp times the Newton-Schulz work of one owner, 2 bytes per element to each tp rank.
The learning rate is adjusted by the whole matrix's shape.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from zeroshard.engine.runtime._flat_group import FlatParamGroup
from zeroshard.engine.runtime._home import HomeKind, refresh_homes
from zeroshard.engine.runtime._stepper import StepOutcome
from zeroshard.engine.runtime._tensor_parallel import TensorParallel, split_dim
from zeroshard.engine.runtime.whole._declare import muon_functions
from zeroshard.engine.runtime.whole._exchange import ExchangingStep, MatrixExchange, ShardPiece
from zeroshard.partition import Slot


class MuonStep(ExchangingStep):
    """torch.optim.Muon (`optimizer`, whose first param group is the combined optimizer's
    `offset`-th) on `groups`, its flat groups, each with its exchange in `exchanges`; its
    param groups hold the masters (`bind_masters`)."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        groups: Sequence[FlatParamGroup],
        exchanges: Mapping[int, MatrixExchange],
        offset: int,
        tensor_parallel: TensorParallel | None = None,
    ) -> None:
        """torch's own Newton-Schulz and learning-rate adjustment, so the bits are its; the
        whole shape and split dim of each matrix split over tp, by name."""
        super().__init__(optimizer, groups, exchanges, offset, tensor_parallel)
        functions = muon_functions()
        assert functions is not None  # split_muon() checked it
        self.newton_schulz, self.adjusted_lr = functions
        self.splits = {
            n: (dim, torch.Size(p.shape))
            for g in self.groups
            for n, p in zip(g.names, g.params, strict=True)
            if (dim := split_dim(p)) is not None
        }

    def _orthogonalized(
        self, slots: Sequence[Slot], views: Sequence[torch.Tensor], pg: Mapping[str, Any]
    ) -> list[torch.Tensor]:
        """Each of `views` (the update of the matrix of `slots[i]`, or of this rank's piece
        of it: [Note: Muon under tensor parallelism]) orthogonalized, as this rank holds it."""
        args = (pg["ns_coefficients"], pg["ns_steps"], pg["eps"])
        dims = [self.splits[s.name][0] for s in slots if s.name in self.splits]
        if not dims:
            return [self.newton_schulz(v, *args) for v in views]
        tp = self.tensor_parallel
        assert tp is not None and len(dims) == len(views)  # a split group is split throughout
        wholes = tp.whole_tensors(views, dims)
        return [
            tp.own_piece(self.newton_schulz(w, *args), d) for w, d in zip(wholes, dims, strict=True)
        ]

    def step(self) -> StepOutcome:
        """Every group's momentum and update on its shard, each exchanged update to its
        owner and back orthogonalized, weight decay and the add ([Note: Muon's step,
        split]). Each group's sends start before its own matrices are orthogonalized, and
        every group's before any owner waits, so the collectives overlap the work; a
        group's local adds wait for the next group's update ([Note: Muon's host
        transfers])."""
        arriving = []
        stepped = [g for g in self.groups if g.grad_shard is not None]
        pending: _Down | None = None
        for g in stepped:
            pg = self.optimizer.param_groups[g.key.param_group - self.offset]
            update = self._update(g, pg)
            if pending is not None:
                self._add_all(pending)
                pending = None
            ex = self.exchanges[g.index]
            if ex.active:
                # The pieces are copied into the send buffer: `update` may go after this.
                label = f"Muon updates of group {g.index}"
                arriving.append((g, pg, ex.to_owners(update, label=label)))
            # The weight decay before any add, as torch's Muon orders them per matrix.
            g.master.mul_(1 - float(pg["lr"]) * pg["weight_decay"])
            if ex.local:
                slots = [p.slot for p in ex.local]
                done = self._orthogonalized(slots, ex.local_views(update), pg)
                pending = _down(g, pg, ex.local, done)
        if pending is not None:
            self._add_all(pending)
        returning = []
        for g, pg, (owned, handle) in arriving:
            handle.wait()
            ex = self.exchanges[g.index]
            views = ex.views(owned)
            if views:
                done = self._orthogonalized(ex.owned, views, pg)
                for view, o in zip(views, done, strict=True):
                    # In place: the owner's buffer is ours (NS cast it to bf16 first).
                    view.copy_(o)
            label = f"Muon orthogonalized updates of group {g.index}"
            returning.append((g, pg, ex.from_owners(owned, label=label)))
        for g, pg, (back, handle) in returning:
            handle.wait()
            back_pieces = self.exchanges[g.index].split_back(back)
            if back_pieces:
                pieces, chunks = zip(*back_pieces, strict=True)
                self._add_all(_down(g, pg, pieces, chunks))
        # What gathers read of a master homed on the host follows it (the device's
        # masters are read as they are).
        refresh_homes([g for g in stepped if g.home.kind is HomeKind.HOST])
        return StepOutcome.PUBLISH

    def _add_all(self, down: _Down) -> None:
        """Add each orthogonalized piece of `down` to its group's master, once it is there."""
        if down.ready is not None:
            down.ready.synchronize()
        for piece, update in zip(down.pieces, down.updates, strict=True):
            self._add(down.group, piece, update, down.pg)

    def _add(
        self, g: FlatParamGroup, piece: ShardPiece, update: torch.Tensor, pg: Mapping[str, Any]
    ) -> None:
        """`g`'s master piece minus its matrix's adjusted lr times `update` (the piece's
        orthogonalized elements, or the whole matrix for a local one)."""
        name = piece.slot.name
        shape = self.splits[name][1] if name in self.splits else torch.Size(piece.slot.shape)
        alpha = -self.adjusted_lr(float(pg["lr"]), pg["adjust_lr_fn"], shape)
        target = g.master[piece.start : piece.start + piece.numel]
        target.view_as(update).add_(update, alpha=alpha)

    def _update(self, g: FlatParamGroup, pg: Mapping[str, Any]) -> torch.Tensor:
        """Momentum and Nesterov blend of `g`'s shard, where its master lives (the
        gradient read through its destination: [Note: Muon's step, split]); the update
        cast to bf16, on the device the exchange runs on."""
        state = self.optimizer.state[g.master]
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(g.master)
        buf: torch.Tensor = state["momentum_buffer"]
        momentum = pg["momentum"]
        device = g.process_group.device
        # Pinned where it goes up to a GPU, to go without waiting ([Note: Muon's host
        # transfers]).
        pin = buf.device.type == "cpu" and device.type == "cuda"
        update = torch.empty(buf.shape, dtype=torch.bfloat16, device=buf.device, pin_memory=pin)
        blend: torch.Tensor | None = None  # the Nesterov blend of a piece: one, reused
        for start, grad in g.grads.read(g):
            end = start + grad.numel()
            grad = grad.to(buf.dtype)
            part = buf[start:end].lerp_(grad, 1 - momentum)
            if pg["nesterov"]:
                if blend is None or blend.numel() < grad.numel():
                    blend = torch.empty_like(grad)
                part = torch.lerp(grad, part, momentum, out=blend[: grad.numel()])
            update[start:end] = part
        return update.to(device, non_blocking=pin)


@dataclass(frozen=True)
class _Down:
    """A group's orthogonalized pieces on its master's device, to read once `ready` (the
    event of their copy down; None where nothing was copied) completed."""

    group: FlatParamGroup
    pg: Mapping[str, Any]
    pieces: Sequence[ShardPiece]
    updates: Sequence[torch.Tensor]
    ready: torch.cuda.Event | None


def _down(
    g: FlatParamGroup,
    pg: Mapping[str, Any],
    pieces: Sequence[ShardPiece],
    updates: Sequence[torch.Tensor],
) -> _Down:
    """`updates` (orthogonalized, of `pieces` of `g`'s master) on their way to the master's
    device: from a GPU to the host, into one pinned buffer behind one event ([Note: Muon's
    host transfers])."""
    if g.master.device == updates[0].device:
        return _Down(g, pg, pieces, updates, None)
    host = torch.empty(sum(u.numel() for u in updates), dtype=updates[0].dtype, pin_memory=True)
    down, at = [], 0
    for u in updates:
        down.append(host[at : at + u.numel()].view(u.shape).copy_(u, non_blocking=True))
        at += u.numel()
    ready = torch.cuda.Event()  # type: ignore[no-untyped-call]
    ready.record()
    return _Down(g, pg, pieces, down, ready)
