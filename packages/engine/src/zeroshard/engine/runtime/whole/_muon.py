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
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from zeroshard.engine.runtime._flat_group import FlatParamGroup
from zeroshard.engine.runtime._stepper import StepOutcome
from zeroshard.engine.runtime.whole._declare import muon_functions
from zeroshard.engine.runtime.whole._exchange import ExchangingStep, ShardPiece


class MuonStep(ExchangingStep):
    """torch.optim.Muon (`optimizer`, whose first param group is the combined optimizer's
    `offset`-th) on `groups`, its flat groups; `owners` by process-group label."""

    def bind(self) -> None:
        """torch's own Newton-Schulz and learning-rate adjustment, so the bits are its."""
        functions = muon_functions()
        assert functions is not None  # split_muon() checked it
        self.newton_schulz, self.adjusted_lr = functions

    def _orthogonalize(self, update: torch.Tensor, pg: Mapping[str, Any]) -> torch.Tensor:
        return self.newton_schulz(update, pg["ns_coefficients"], pg["ns_steps"], pg["eps"])

    def step(self) -> StepOutcome:
        """Every group's momentum and update on its shard, each exchanged update to its
        owner and back orthogonalized, weight decay and the add ([Note: Muon's step,
        split]). Each group's sends start before its own matrices are orthogonalized, and
        every group's before any owner waits, so the collectives overlap the work."""
        arriving = []
        for g in (g for g in self.groups if g.master.grad is not None):
            pg = self.optimizer.param_groups[g.key.param_group - self.offset]
            update = self._update(g, pg)
            ex = self.exchanges[g.index]
            if ex.active:
                # The pieces are copied into the send buffer: `update` may go after this.
                label = f"Muon updates of group {g.index}"
                arriving.append((g, pg, ex.to_owners(update, label=label)))
            # The weight decay before any add, as torch's Muon orders them per matrix.
            g.master.mul_(1 - float(pg["lr"]) * pg["weight_decay"])
            for piece, view in zip(ex.local, ex.local_views(update), strict=True):
                self._add(g, piece, self._orthogonalize(view, pg), pg)
        returning = []
        for g, pg, (owned, handle) in arriving:
            handle.wait()
            ex = self.exchanges[g.index]
            for view in ex.views(owned):
                # In place: the owner's buffer is ours, and NS casts (a no-op on bf16) first.
                view.copy_(self._orthogonalize(view, pg))
            label = f"Muon orthogonalized updates of group {g.index}"
            returning.append((g, pg, ex.from_owners(owned, label=label)))
        for g, pg, (back, handle) in returning:
            handle.wait()
            for piece, chunk in self.exchanges[g.index].split_back(back):
                self._add(g, piece, chunk, pg)
        return StepOutcome.PUBLISH

    def _add(
        self, g: FlatParamGroup, piece: ShardPiece, update: torch.Tensor, pg: Mapping[str, Any]
    ) -> None:
        """`g`'s master piece minus its matrix's adjusted lr times `update` (the piece's
        orthogonalized elements, or the whole matrix for a local one)."""
        shape = torch.Size(piece.slot.shape)
        alpha = -self.adjusted_lr(float(pg["lr"]), pg["adjust_lr_fn"], shape)
        target = g.master[piece.start : piece.start + piece.numel]
        target.view_as(update).add_(update, alpha=alpha)

    def _update(self, g: FlatParamGroup, pg: Mapping[str, Any]) -> torch.Tensor:
        """Momentum and Nesterov blend of `g`'s shard; the update cast to bf16."""
        grad = g.master.grad
        assert grad is not None
        state = self.optimizer.state[g.master]
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(grad)
        buf: torch.Tensor = state["momentum_buffer"]
        momentum = pg["momentum"]
        buf.lerp_(grad, 1 - momentum)
        update = grad.lerp(buf, momentum) if pg["nesterov"] else buf
        return update.bfloat16()
