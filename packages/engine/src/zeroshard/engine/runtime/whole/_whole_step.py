"""`WholeParamStep`: a whole-matrix optimizer's own `step()` on full-shape fp32 tensors,
each matrix at its owner ([Note: whole-matrix optimizers] in `_declare.py`).

[Note: whole parameters]
The optimizer steps one `nn.Parameter` per matrix this rank owns (`params`, the same
objects for the whole run, so its state is keyed by them): during `step()` their data
and gradient are the full master and gradient, as views of this rank's shard where
the matrix lies whole in it, else of the owner's buffer the exchange filled; between
steps they hold no memory. Its state (momentum, preconditioners) lives on the owner only,
full-shape, and checkpoints store it by parameter name. Per exchanged element a step
moves 4 bytes of gradient and 4 of master to the owner and 4 of master back.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import nn

from zeroshard.engine.runtime._flat_group import FlatParamGroup
from zeroshard.engine.runtime._stepper import StepOutcome, WholeParams
from zeroshard.engine.runtime._tensor_parallel import TensorParallel
from zeroshard.engine.runtime.whole._exchange import ExchangingStep
from zeroshard.engine.runtime.whole._owners import MatrixOwners


class WholeParamStep(ExchangingStep):
    """`optimizer` (whose first param group is the combined optimizer's `offset`-th) on
    whole parameters at their owners; `owners` by process-group label. Binds the
    optimizer's param groups to this rank's whole parameters (`params`, by name)."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        groups: Sequence[FlatParamGroup],
        owners: Mapping[str, MatrixOwners],
        offset: int,
        tensor_parallel: TensorParallel | None = None,
    ) -> None:
        """Bind the optimizer's param groups to one empty whole parameter per matrix this
        rank owns (they replace the masters `bind_masters` gave it)."""
        super().__init__(optimizer, groups, owners, offset, tensor_parallel)
        self.params: dict[str, nn.Parameter] = {}
        bound: list[list[torch.Tensor]] = [[] for _ in optimizer.param_groups]
        for g in self.groups:
            ex = self.exchanges[g.index]
            for slot in [p.slot for p in ex.local] + ex.owned:
                p = nn.Parameter(g.master.new_empty(0))
                self.params[slot.name] = p
                bound[g.key.param_group - self.offset].append(p)
        for pg, params in zip(optimizer.param_groups, bound, strict=True):
            pg["params"] = params
        self.whole = WholeParams(frozenset(n for g in self.groups for n in g.names), self.params)

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
