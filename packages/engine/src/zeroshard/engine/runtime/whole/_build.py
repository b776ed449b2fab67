"""Whole-matrix optimizers as `initialize` composes them: what is refused, and the
stepper each gets ([Note: whole-matrix optimizers] in _declare.py)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from zeroshard.engine.runtime._flat_group import FlatParamGroup
from zeroshard.engine.runtime._group_plan import PlannedFlatGroup
from zeroshard.engine.runtime._home import HomeKind
from zeroshard.engine.runtime._owner_state import OwnerState
from zeroshard.engine.runtime._stepper import Stepper, WholeParams
from zeroshard.engine.runtime._tensor_parallel import TensorParallel, own_path
from zeroshard.engine.runtime.whole._declare import split_muon, steps_whole
from zeroshard.engine.runtime.whole._exchange import MatrixExchange, matrix_exchanges
from zeroshard.engine.runtime.whole._muon import MuonStep
from zeroshard.engine.runtime.whole._owners import DEFAULT_NS_STEPS, plan_owners
from zeroshard.engine.runtime.whole._whole_step import WholeParamStep, on_host, whole_parameters


def whole_param_groups(optimizers: Sequence[torch.optim.Optimizer]) -> dict[int, int]:
    """Each whole-matrix optimizer's param groups, by their index among all optimizers'
    param groups in turn (`GroupKey.param_group`) -> its Newton-Schulz iterations."""
    out: dict[int, int] = {}
    k = 0
    for o in optimizers:
        for pg in o.param_groups:
            if steps_whole(o):
                out[k] = int(pg.get("ns_steps", DEFAULT_NS_STEPS))
            k += 1
    return out


def owned_host_state(
    groups: Sequence[PlannedFlatGroup],
    optimizers: Sequence[torch.optim.Optimizer],
    dtype: torch.dtype,
    rank: int,
) -> dict[int, int]:
    """The bytes of state that `optimizers`' whole-parameter ones keep on rank `rank`'s
    host between steps (its rank in the groups' process group), by param group (index
    among all optimizers' in turn): that of the matrices it owns among the planned
    `groups` offload homes there ([Note: whole parameters offloaded]), each the whole
    matrix's (under tp too) in `dtype`, the masters', as `OwnerState` measures it for
    the planner."""
    kinds = [o for o in optimizers for _ in o.param_groups]
    declared = {k for k, o in enumerate(kinds) if steps_whole(o) and not split_muon(o)}
    owners = plan_owners(((g.key, g.layout) for g in groups), whole_param_groups(optimizers))
    state = OwnerState(optimizers, dtype)
    out = dict.fromkeys(sorted(declared), 0)
    for g in groups:
        if g.home is not HomeKind.HOST or not g.trainable or g.key.param_group not in declared:
            continue
        # A DTensor's shape is the whole matrix's, which every tp rank of its owner steps.
        shapes = {n: tuple(p.shape) for n, p in g.named}
        owner = owners[g.key.process_group].owner
        out[g.key.param_group] += sum(
            state.nbytes(g.key.param_group, shapes[s.name])
            for s in g.layout.slots
            if s.numel and owner[s.name] == rank
        )
    return out


class WholeMatrices:
    """The whole-matrix optimizers among `optimizers` over their flat `groups`, complete
    once built: each matrix's owner, planned once for all of them (`plan_owners`), each
    trainable group's exchange with the owners, and for those that step whole parameters
    with their own step() one empty whole parameter per matrix this rank owns (`bound`:
    what each of their param groups steps in place of the masters, for `bind_masters`;
    `params`: by name, for checkpoints). Their steppers are built on param groups bound
    so (matrices split over `tensor_parallel` joined whole for either kind; the host state
    of offloaded groups' matrices pinned if `pin_memory`, offload.pin_memory)."""

    def __init__(
        self,
        optimizers: Sequence[torch.optim.Optimizer],
        groups: Sequence[FlatParamGroup],
        tensor_parallel: TensorParallel | None,
        pin_memory: bool,
    ) -> None:
        owners = plan_owners(((g.key, g.layout) for g in groups), whole_param_groups(optimizers))
        self._tensor_parallel = tensor_parallel
        self._pin_memory = pin_memory
        self._exchanges: dict[int, MatrixExchange] = {}
        # Each whole-parameter optimizer's (by its first param group's index): by name.
        self._params: dict[int, dict[str, nn.Parameter]] = {}
        self.bound: dict[int, list[torch.Tensor]] = {}
        names: set[str] = set()
        hosted: set[str] = set()
        offset = 0
        for o in optimizers:
            ks = range(offset, offset + len(o.param_groups))
            mine = [g for g in groups if g.key.param_group in ks]
            if steps_whole(o):
                exchanges = matrix_exchanges(mine, owners)
                self._exchanges.update(exchanges)
                if not split_muon(o):
                    _refuse_own_process_groups(o, mine)
                    params = self._params[offset] = whole_parameters(mine, exchanges)
                    hosted |= on_host(mine, exchanges)
                    self.bound.update({k: [] for k in ks})
                    for g in (g for g in mine if g.trainable):
                        names.update(g.names)
                        stepped = exchanges[g.index].stepped_here()
                        self.bound[g.key.param_group] += [params[s.name] for s in stepped]
            offset += len(o.param_groups)
        owned = {n: p for params in self._params.values() for n, p in params.items()}
        # What whole-parameter optimizers step whole by name (None: none do).
        self.params = (
            WholeParams(frozenset(names), owned, frozenset(hosted)) if self._params else None
        )

    def stepper(
        self, optimizer: torch.optim.Optimizer, groups: Sequence[FlatParamGroup], offset: int
    ) -> Stepper:
        """The stepper of whole-matrix `optimizer` (its first param group the `offset`-th
        of all) over `groups`, its flat groups: torch's Muon split (`MuonStep`, which
        joins the pieces of matrices split over tensor parallelism), another on the whole
        parameters its param groups were bound to (`WholeParamStep`, which joins them
        too)."""
        if split_muon(optimizer):
            return MuonStep(optimizer, groups, self._exchanges, offset, self._tensor_parallel)
        return WholeParamStep(
            optimizer,
            groups,
            self._exchanges,
            self._params[offset],
            offset,
            self._tensor_parallel,
            self._pin_memory,
        )


def _refuse_own_process_groups(
    optimizer: torch.optim.Optimizer, groups: Sequence[FlatParamGroup]
) -> None:
    """Refuse whole parameters by name for parameters on a process group of their own."""
    own = sorted({n for g in groups if own_path(g.key.process_group) is not None for n in g.names})
    if own:
        # Their state is checkpointed by name, and several instances share names.
        raise ValueError(
            f"{type(optimizer).__name__} steps whole parameters by name, which "
            f"parameters on a process group of their own ({own[:3]}) do not have "
            "alone: give them another optimizer"
        )
