"""`WholeParamStep`: a whole-matrix optimizer's own `step()` on full-shape fp32 tensors,
each matrix at its owner ([Note: whole-matrix optimizers] in `_declare.py`).

[Note: whole parameters]
The optimizer steps one `nn.Parameter` per matrix this rank owns (`params`, the same
objects for the whole run, so its state is keyed by them): during `step()` their data
and gradient are the full master and gradient, as views of this rank's shard where
the matrix lies whole in it, else of the owner's buffer the exchange filled; between
steps they hold no memory. Its state (momentum, preconditioners) lives on the owner only,
full-shape, and checkpoints store it by parameter name. Per exchanged element a step
moves the gradient and the master to the owner and the master back, each in the master
dtype (4 bytes each with fp32 masters, 2 with bf16 ones).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import nn

from zeroshard.engine.runtime._flat_group import FlatParamGroup
from zeroshard.engine.runtime._stepper import StepOutcome
from zeroshard.engine.runtime.whole._exchange import ExchangingStep, MatrixExchange


def whole_parameters(
    groups: Sequence[FlatParamGroup], exchanges: Mapping[int, MatrixExchange]
) -> dict[str, nn.Parameter]:
    """One empty whole parameter per matrix this rank owns among `groups`' trainable ones
    (by name, in the order their param groups step them: [Note: whole parameters])."""
    return {
        slot.name: nn.Parameter(g.master.new_empty(0))
        for g in groups
        if g.trainable
        for slot in exchanges[g.index].stepped_here()
    }


class WholeParamStep(ExchangingStep):
    """`optimizer` (whose first param group is the combined optimizer's `offset`-th) on
    whole parameters at their owners; each of `groups` with its exchange in `exchanges`.
    Its param groups hold `params` (by name: one empty whole parameter per matrix this
    rank owns), bound before it is built (`WholeMatrices`, `bind_masters`)."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        groups: Sequence[FlatParamGroup],
        exchanges: Mapping[int, MatrixExchange],
        params: Mapping[str, nn.Parameter],
        offset: int,
    ) -> None:
        super().__init__(optimizer, groups, exchanges, offset)
        self.params = dict(params)

    def step(self) -> StepOutcome:
        """Gradients and masters to the owners, the optimizer's step, masters back."""
        todo = [(g, g.master.detach(), g.master.grad) for g in self.groups]
        stepped = [(g, m, gr) for g, m, gr in todo if gr is not None]
        arriving = []
        for g, master, grad in stepped:
            ex = self.exchanges[g.index]
            if ex.active:
                grads, gh = ex.to_owners(grad, label=f"gradients of group {g.index}")
                masters, mh = ex.to_owners(master, label=f"masters of group {g.index}")
                arriving.append((g, grads, masters, (gh, mh)))
        for g, master, grad in stepped:
            ex = self.exchanges[g.index]
            names = [p.slot.name for p in ex.local]
            for name, m, gr in zip(
                names, ex.local_views(master), ex.local_views(grad), strict=True
            ):
                self._expose(name, m, gr)
        for g, grads, masters, handles in arriving:
            for h in handles:
                h.wait()
            ex = self.exchanges[g.index]
            names = [s.name for s in ex.owned]
            for name, m, gr in zip(names, ex.views(masters), ex.views(grads), strict=True):
                self._expose(name, m, gr)
        try:
            self.optimizer.step()
        finally:
            for p in self.params.values():
                p.data = p.data.new_empty(0)
                p.grad = None
        returning = []
        for g, _, masters, _ in arriving:
            ex = self.exchanges[g.index]
            back = ex.from_owners(masters, label=f"masters of group {g.index}")
            returning.append((g, back))
        for g, (buffer, handle) in returning:
            handle.wait()
            shard = g.master.detach()
            for piece, chunk in self.exchanges[g.index].split_back(buffer):
                shard[piece.start : piece.start + piece.numel].copy_(chunk)
        return StepOutcome.PUBLISH

    def _expose(self, name: str, master: torch.Tensor, grad: torch.Tensor) -> None:
        p = self.params[name]
        p.data = master
        p.grad = grad
