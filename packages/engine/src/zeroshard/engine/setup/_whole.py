"""Several optimizers and whole-matrix ones in `initialize`: what is refused, and the
stepper each optimizer gets ([Note: whole-matrix optimizers] in runtime/whole/_declare.py)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from zeroshard.engine.config._config import ZeroConfig
from zeroshard.engine.runtime._flat_group import FlatParamGroup
from zeroshard.engine.runtime._stepper import DeviceStep, StepEach, Stepper
from zeroshard.engine.runtime._tensor_parallel import TensorParallel
from zeroshard.engine.runtime.whole._declare import split_muon, steps_whole
from zeroshard.engine.runtime.whole._muon import MuonStep
from zeroshard.engine.runtime.whole._owners import DEFAULT_NS_STEPS, plan_owners
from zeroshard.engine.runtime.whole._whole_step import WholeParams, WholeParamStep


def check_whole_optimizers(optimizers: Sequence[torch.optim.Optimizer], cfg: ZeroConfig) -> None:
    """Refuse what the whole-matrix and combined steps do not run: CPU offload of them."""
    if not cfg.offload.optimizer:
        return
    whole = [type(o).__name__ for o in optimizers if steps_whole(o)]
    if whole:
        raise ValueError(
            f"offload_optimizer: {', '.join(whole)} steps whole matrices, each on one rank's "
            "device, which CPU offload does not do: turn offload_optimizer off (its state "
            "is sharded on the devices like AdamW's: 4 bytes per parameter over the ranks)"
        )
    if len(optimizers) > 1:
        raise ValueError(
            f"offload_optimizer steps one optimizer on the CPU, got {len(optimizers)}: pass "
            "one optimizer (param groups may differ in their settings), or turn offload off"
        )


def check_whole_mesh(optimizers: Sequence[torch.optim.Optimizer], mesh: object | None) -> None:
    """Refuse a declared whole-matrix optimizer under tensor parallelism (`initialize`'s
    `device_mesh`); torch's Muon brings a split matrix's pieces together ([Note: Muon under
    tensor parallelism])."""
    declared = [type(o).__name__ for o in optimizers if steps_whole(o) and not split_muon(o)]
    if declared and mesh is not None:
        raise ValueError(
            f"device_mesh: {', '.join(declared)} steps whole parameters at one owner, keeping "
            "their state by name, which does not yet bring the pieces of a matrix split over "
            "tp together (torch.optim.Muon does): give the split matrices another optimizer, "
            "or train without tp"
        )


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


def whole_matrix_steppers(
    optimizers: Sequence[torch.optim.Optimizer],
    groups: Sequence[FlatParamGroup],
    tensor_parallel: TensorParallel | None = None,
) -> tuple[Stepper, WholeParams | None]:
    """One stepper per optimizer, over the flat groups of its param groups: torch's Muon
    split (`MuonStep`, which joins the pieces of matrices split over `tensor_parallel`),
    another whole-matrix one on whole parameters (`WholeParamStep`), any other on the
    device (`DeviceStep`); stepped in turn. Also the whole parameters this rank steps, by
    name (None: no optimizer steps any)."""
    owners = plan_owners(((g.key, g.layout) for g in groups), whole_param_groups(optimizers))
    parts: list[Stepper] = []
    whole: WholeParams | None = None
    offset = 0
    for o in optimizers:
        ks = range(offset, offset + len(o.param_groups))
        mine = [g for g in groups if g.key.param_group in ks]
        if split_muon(o):
            parts.append(MuonStep(o, mine, owners, offset, tensor_parallel))
        elif steps_whole(o):
            own = sorted({n for g in mine if g.key.process_group != "default" for n in g.names})
            if own:
                # Their state is checkpointed by name, and several instances share names.
                raise ValueError(
                    f"{type(o).__name__} steps whole parameters by name, which parameters on "
                    f"a process group of their own ({own[:3]}) do not have alone: give "
                    "them another optimizer"
                )
            step = WholeParamStep(o, mine, owners, offset)
            whole = step.whole if whole is None else _joined(whole, step.whole)
            parts.append(step)
        else:
            parts.append(DeviceStep(o))
        offset += len(o.param_groups)
    return (parts[0] if len(parts) == 1 else StepEach(parts)), whole


def _joined(a: WholeParams, b: WholeParams) -> WholeParams:
    return WholeParams(a.names | b.names, {**a.owned, **b.owned})
